"""The worker's DeltaCoalescer: what it publishes, joined, is the engine's text, to the last character."""

import pytest

from inference.engine import Engine
from inference.events import Done, SamplingParams, TextDelta
from inference.synth import synth
from inference.worker import DeltaCoalescer
from tests.chosen_ids import ChosenIds


def coalescer(flush_interval_s):
    published = []
    return DeltaCoalescer(lambda kind, data: published.append((kind, data)), flush_interval_s), published


def test_a_last_delta_without_tokens_is_published():
    # The engine's last delta may carry text and no token: what it held back for a stop string's start, or an
    # unfinished character, until the generation ended.
    deltas, published = coalescer(0.0)
    deltas.add(TextDelta("ab", [5], 0.1))
    deltas.add(TextDelta("c", [], 0.2))
    deltas.flush()
    assert "".join(data["text"] for _, data in published) == "abc"
    assert published[-1][1]["n"] == 1 and published[-1][1]["token_ids"] == []
    # nothing at all to say: nothing published
    deltas.flush()
    deltas.add(TextDelta("", [], 0.3))
    deltas.flush()
    assert len(published) == 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.load(synth("tiny-qwen3", tmp_path_factory.mktemp("worker") / "q", seed=0), device="cpu")


@pytest.mark.parametrize("flush_interval_s", [0.0, 10.0])
@pytest.mark.parametrize(
    ("text", "stop"), [("x ab", "abc"), ("he said 😀", "😀!"), ("hello world", "world"), ("ab", "abcd")]
)
def test_what_the_worker_publishes_is_the_engines_text(engine, monkeypatch, flush_interval_s, text, stop):
    # as Worker._run feeds it: every TextDelta, then a flush before the Done
    ids = engine.tokenizer.encode(text, add_special=False)
    monkeypatch.setattr(engine, "runner", ChosenIds(ids))
    deltas, published = coalescer(flush_interval_s)
    for event in engine.generate(
        engine.encode_prompt("q"), SamplingParams(max_new_tokens=len(ids), stop=(stop,))
    ):
        if isinstance(event, TextDelta):
            deltas.add(event)
        elif isinstance(event, Done):
            deltas.flush()
            done = event
    cut = text.find(stop)
    assert done.text == (text if cut < 0 else text[:cut])
    assert "".join(data["text"] for _, data in published) == done.text
    assert sum(len(data["token_ids"]) for _, data in published) == done.stats.completion_tokens
