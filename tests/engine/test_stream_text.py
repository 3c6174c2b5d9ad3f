"""The text a generation streams, on the real tokenizers of the tiny presets: the deltas (and Done.text) joined
are what `decode` makes of the prompt and the new ids together, past the prompt's own text, whatever the ids
(byte tokens cut anywhere, UTF-8 that is never completed or turns invalid); and transformers decodes the same.

tiny-laneformer has a SentencePiece tokenizer with byte fallback (a run of "<0xF0>" tokens decodes as a whole),
tiny-qwen3 and tiny-llama byte-level BPE ones. A runner that emits chosen ids stands in for the model, so that
the engine's own decoder and stop filter run on ids the test picks."""

import random

import pytest

from common.events import Done, SamplingParams, TextDelta
from inference.engine import Engine
from inference.synth import synth
from tests.support.chosen_ids import ChosenIds

PRESETS = ("tiny-laneformer", "tiny-qwen3", "tiny-llama")
# Characters of 1 to 4 UTF-8 bytes (which a small vocabulary holds as byte tokens), whitespace, words
PIECES = [
    "😀",
    "👍🏽",
    "🐍",
    " 你好",
    "日本語",
    "龘",
    "e\u0301",
    "\n",
    "\t",
    "\n\t",
    " ",
    "  x",
    " done",
    "'",
    "é",
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return {name: Engine.load(synth(name, root / name, seed=0), device="cpu") for name in PRESETS}


def generate(engine, monkeypatch, prompt_ids, new_ids, **params):
    monkeypatch.setattr(engine, "runner", ChosenIds(new_ids))
    events = list(engine.generate(prompt_ids, SamplingParams(max_new_tokens=len(new_ids) + 1, **params)))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    done = events[-1]
    assert isinstance(done, Done)
    return deltas, done


def continuation(tok, context, ids):
    return tok.decode(list(context) + list(ids))[len(tok.decode(context)) :]


def stream(tok, ids, context=()):
    decoder = tok.stream_decoder(context)
    deltas = [decoder.push(i) for i in ids]
    return deltas, decoder.flush()


def byte_ids(tok, data: bytes) -> list[int]:
    return [tok._tok.token_to_id(f"<0x{b:02X}>") for b in data]


def random_ids(tok, rng: random.Random) -> list[int]:
    """Text rich in multi-byte characters and byte tokens, sometimes broken: a token dropped, a random byte
    token or special token put in, ids drawn from the whole vocabulary."""
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30)))
    ids = tok.encode(text, add_special=False)
    kind = rng.randrange(5)
    if kind == 1 and len(ids) > 1:  # a character cut short (or a word lost)
        del ids[rng.randrange(len(ids))]
    elif kind == 2:  # a stray byte: a lead byte, a continuation byte, ASCII
        stray = (
            byte_ids(tok, bytes([rng.choice([0x80, 0xBF, 0xF0, 0xE6, 0x41])]))
            if tok.byte_fallback_ids
            else []
        )
        stray = stray or [rng.randrange(tok.vocab_size)]
        at = rng.randrange(len(ids) + 1)
        ids[at:at] = stray
    elif kind == 3:  # a special token, which decode skips (a run of bytes goes on past it)
        at = rng.randrange(len(ids) + 1)
        ids[at:at] = [rng.choice(sorted(tok.special_ids - tok.stop_ids))]
    elif kind == 4:
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        ids = [i for i in ids if i not in tok.stop_ids]
    return ids


@pytest.mark.parametrize("preset", PRESETS)
def test_the_stream_is_the_decode_of_all_the_ids_in_the_prompts_context(engines, preset):
    tok = engines[preset].tokenizer
    assert bool(tok.byte_fallback_ids) == (preset == "tiny-laneformer")
    rng = random.Random(preset)
    # prompts that end in a word, in a run of byte tokens (the emoji), inside a character's bytes, or none
    contexts = [
        [],
        tok.encode_text("x = 1"),
        tok.encode_text("# 😀😀"),
        tok.encode_text("s = '日本語 🐍\t"),
        tok.encode_text("def f():\n    return 'a' * 40 + '" + "😀" * 9),
    ]
    contexts.append(contexts[2][:-1])  # the prompt's last character unfinished
    for _ in range(400):
        ids = random_ids(tok, rng)
        context = rng.choice(contexts)
        deltas, rest = stream(tok, ids, context)
        assert "".join(deltas) + rest == continuation(tok, context, ids), (context, ids)


@pytest.mark.parametrize("preset", PRESETS)
def test_valid_text_streams_whole_characters_in_a_bounded_window(engines, preset):
    tok = engines[preset].tokenizer
    rng = random.Random(preset + "valid")
    for _ in range(100):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(20, 80)))
        ids = tok.encode(text, add_special=False)
        decoder = tok.stream_decoder(tok.encode_text("print(1)"))
        deltas, longest = [], 0
        for i in ids:
            deltas.append(decoder.push(i))
            longest = max(longest, len(decoder._ids))
        deltas.append(decoder.flush())
        assert "".join(deltas) == continuation(tok, tok.encode_text("print(1)"), ids)
        assert not any("\ufffd" in d for d in deltas)  # no character is ever shown broken
        # each push decodes a few tokens, not the whole generation: at most twice the window, the longest run
        # of byte tokens (held until a token ends it) and one
        run = longest_run = 0
        for i in ids:
            run = run + 1 if i in tok.byte_fallback_ids else 0
            longest_run = max(longest_run, run)
        assert longest <= 2 * decoder.WINDOW + longest_run + 4


def test_emoji_in_a_row_and_then_byte_tokens_for_whitespace(engines, monkeypatch):
    # The audit's case: 😀😀😀😀'\n on a SentencePiece tokenizer with byte fallback; the window used to start
    # inside the run of the emoji's bytes, which then decoded as U+FFFD per byte.
    engine = engines["tiny-laneformer"]
    tok = engine.tokenizer
    prompt = engine.encode_prompt("s = '")
    for text in ["😀😀😀😀'\n", "😀\n\t😀\t\n", "龘靐齉爩鱻麤\n", "👍🏽👍🏽\t'"]:
        new = tok.encode(text, add_special=False)
        assert set(new) & tok.byte_fallback_ids
        deltas, done = generate(engine, monkeypatch, prompt, new)
        expected = continuation(tok, prompt, new)
        assert expected == " " + text  # the token after "'" starts with "▁"
        assert "".join(deltas) == done.text == expected
        assert not any("\ufffd" in d for d in deltas)


def test_a_generation_that_goes_on_with_the_prompts_run_of_bytes(engines, monkeypatch):
    # The prompt ends in the bytes of two emoji and the model goes on with the bytes of a third: one run of
    # byte tokens across the prompt's end, which the window must not cut.
    engine = engines["tiny-laneformer"]
    tok = engine.tokenizer
    prompt = engine.encode_prompt("# 😀😀")
    assert prompt[-8:] == byte_ids(tok, "😀😀".encode())
    new = byte_ids(tok, "😀".encode()) + tok._plain.encode(" done", add_special_tokens=False).ids
    deltas, done = generate(engine, monkeypatch, prompt, new)
    assert "".join(deltas) == done.text == continuation(tok, prompt, new) == "😀 done"


def test_bytes_that_turn_invalid_are_never_shown_before(engines, monkeypatch):
    # With byte fallback a run of bytes decodes as a whole: the bytes of 😀 then a stray continuation byte make
    # the whole run U+FFFD, the emoji included. The stream holds a run back until a token ends it, so what it
    # shows is what transformers decodes, and never an emoji it would have to take back.
    transformers = pytest.importorskip("transformers")
    engine = engines["tiny-laneformer"]
    tok = engine.tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(engine.path))
    prompt = engine.encode_prompt("x = 1")

    def words(text):
        return tok._plain.encode(text, add_special_tokens=False).ids

    for tail in (b"\x80", b"", b"\xf0\x9f"):
        new = words(" a") + byte_ids(tok, "😀".encode() + tail) + words(" b")
        deltas, done = generate(engine, monkeypatch, prompt, new)
        full = theirs.decode(prompt + new, skip_special_tokens=True)
        expected = full[len(theirs.decode(prompt, skip_special_tokens=True)) :]
        assert "".join(deltas) == done.text == expected == continuation(tok, prompt, new)
        assert ("😀" in expected) == (tail == b"")
        start = len(words(" a"))
        assert all(d == "" for d in deltas[start : start + 4 + len(tail)])  # the run is held while it lasts
        # ending on the run: flushed at the end as decode shows it
        deltas, done = generate(engine, monkeypatch, prompt, new[:-1])
        assert "".join(deltas) == done.text == continuation(tok, prompt, new[:-1])


@pytest.mark.parametrize("preset", PRESETS)
def test_stop_strings_over_multibyte_text(engines, monkeypatch, preset):
    engine = engines[preset]
    tok = engine.tokenizer
    prompt = engine.encode_prompt("x = ")
    new = tok._plain.encode("ok 😀😀 tail\t日本語", add_special_tokens=False).ids
    full = continuation(tok, prompt, new)
    for stop, shown in [("😀😀", full[: full.find("😀😀")]), ("本", full[: full.find("本")]), ("zz", full)]:
        deltas, done = generate(engine, monkeypatch, prompt, new, stop=(stop,))
        assert "".join(deltas) == done.text == shown
        assert done.finish_reason == ("length" if stop == "zz" else "stop")
