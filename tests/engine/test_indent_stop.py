"""llama.cpp's n_indent (inference/engine.py IndentStop): a completion inside a block stops before the first line
indented less than n_indent columns, whatever the pieces the text arrives in, and together with stop strings."""

import pytest

from common.events import SamplingParams
from common.names import default_model
from inference.engine import Engine, IndentStop, StopStrings, cut_text, why_it_ended
from inference.fim_training import psm_prompt

BODY = "x = 1\n    y = 2\n\n    \tz\n  w = 3\nv\n"


def cut_by_rule(text: str, columns: int) -> str:
    """The rule written plainly: the text up to and including the newline before the first later line that
    has code on it and starts with fewer than `columns` spaces or tabs."""
    lines = text.split("\n")
    kept = [lines[0]]
    for line in lines[1:]:
        depth = len(line) - len(line.lstrip(" \t"))
        if columns and depth < columns and line.strip():
            return "\n".join(kept) + "\n"
        kept.append(line)
    return text


def streamed(pieces: list[str], columns: int, stop: tuple[str, ...] = ()) -> tuple[str, bool]:
    stops, indent = StopStrings(stop), IndentStop(columns)
    shown = []
    for piece in pieces:
        text, matched = cut_text(stops, indent, piece)
        shown.append(text)
        if matched:
            return "".join(shown), True
    text, matched = cut_text(stops, indent, "", last=True)
    return "".join(shown) + text, matched


@pytest.mark.parametrize("columns", [0, 1, 2, 4, 5])
def test_every_split_of_the_text_cuts_where_the_rule_says(columns):
    expected = cut_by_rule(BODY, columns)
    for size in (1, 2, 3, 7, len(BODY)):
        pieces = [BODY[i : i + size] for i in range(0, len(BODY), size)]
        assert streamed(pieces, columns) == (expected, expected != BODY), (columns, size)


def test_blank_lines_and_whitespace_at_the_end_never_stop_and_are_kept():
    text = "a\n\n\n   \n    b\n  "  # ends inside a line whose depth is unknown: it is text, not a stop
    assert streamed(list(text), 4) == (text, False)
    assert IndentStop(4).push("first line at column 0 is the cursor's own\n    next") == (
        "first line at column 0 is the cursor's own\n    next",
        False,
    )


def test_a_stop_string_before_the_dedent_wins_and_the_held_whitespace_before_it_is_kept():
    assert streamed(list("a\n    b END\nc\n"), 4, stop=("END",)) == ("a\n    b ", True)
    assert streamed(list("a\n   END"), 4, stop=("END",)) == ("a\n   ", True)
    assert streamed(list("a\nb END"), 4, stop=("END",)) == ("a\n", True)


def test_the_indentation_rule_is_what_ended_a_text_it_cut_before_a_stop_string():
    # the rule holds the newline, then "x #" both starts a shallower line and holds the stop string
    stops, indent = StopStrings(("#",)), IndentStop(4)
    for piece in ("    a = 1", "\n", "x #"):
        text, matched = cut_text(stops, indent, piece)
    assert matched and stops.matched == "#" and indent.stopped
    assert why_it_ended("stop", stops, indent, [7], frozenset()) == ("indent", None)
    assert why_it_ended("stop", StopStrings(("#",)), IndentStop(0), [7], frozenset({7})) == ("stop_token", 7)
    assert why_it_ended("length", stops, indent, [7], frozenset()) == ("length", None)


def test_the_value_is_checked():
    for bad in (-1, 257, 2.0, True, "4"):
        with pytest.raises(ValueError, match="n_indent"):
            SamplingParams(n_indent=bad)


def test_the_default_models_middle_ends_with_its_function():
    # a function whose last lines were taken out: without n_indent the model runs on past the function's end
    engine = Engine.load(default_model(), device="cpu")
    prefix = 'def load(path):\n    """Read a file."""\n    with open(path) as f:\n'
    suffix = "    return data\n\n\ndef save(path, data):\n    pass\n"
    ids = engine.tokenizer.encode(psm_prompt(prefix, suffix), add_special=False)
    *_, free = engine.generate(ids, SamplingParams(max_new_tokens=60))
    *_, kept = engine.generate(ids, SamplingParams(max_new_tokens=60, n_indent=4))
    assert cut_by_rule(free.text, 4) != free.text, "the free middle no longer passes the function's end"
    assert kept.text == cut_by_rule(free.text, 4) and kept.finish_reason == "stop"
    assert (kept.ended_by, kept.stop_reason) == ("indent", None)
