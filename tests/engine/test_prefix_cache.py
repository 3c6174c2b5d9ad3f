"""Prefix reuse (inference/prefix_cache.py): a follow-up prefills only what is new, and generates exactly what a
cold start of the whole prompt generates, on the reference runner (CPU) with the default model and a tiny preset
of every family (sliding windows and the Laneformer's delayed reductions included)."""

import random

import pytest
import torch

from common.events import Done, Prefilled, SamplingParams
from common.names import default_model
from inference.engine import Engine
from inference.model import KVCache
from inference.prefix_cache import PrefixCache, common_prefix
from inference.synth import synth

FAMILIES = ["tiny-laneformer", "tiny-llama", "tiny-qwen2", "tiny-qwen3"]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    paths = {name: synth(name, root / name, seed=0) for name in FAMILIES}
    paths["default"] = default_model()
    return paths


def engines(path, monkeypatch) -> tuple[Engine, Engine]:
    """(an engine that reuses prefixes, one that prefills every prompt from its start)."""
    warm = Engine.load(path, device="cpu")
    monkeypatch.setenv("KOG_PREFIX_SLOTS", "0")
    cold = Engine.load(path, device="cpu")
    monkeypatch.delenv("KOG_PREFIX_SLOTS")
    return warm, cold


def run(engine: Engine, prompt_ids: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], Done]:
    tokens, done, prefilled = [], None, None
    for event in engine.generate(prompt_ids, params):
        if isinstance(event, Prefilled):
            prefilled = event
        elif isinstance(event, Done):
            done = event
        else:
            tokens += event.token_ids
    assert prefilled.cached_tokens == done.stats.cached_tokens
    return tokens, done


def ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 1000)) for _ in range(n)]


@pytest.mark.parametrize("model", ["default", *FAMILIES])
def test_a_follow_up_generates_what_a_cold_start_does(checkpoints, monkeypatch, model):
    warm, cold = engines(checkpoints[model], monkeypatch)
    vocab = warm.config.vocab_size
    # longer than tiny-laneformer's 64-token window, so the reused rows reach past it
    first = ids(1, 90, vocab)
    reply, done = run(warm, first)
    assert done.stats.cached_tokens == 0
    follow_up = first + reply + ids(2, 30, vocab)
    got, done = run(warm, follow_up)
    # every row the first request wrote: its prompt and every reply token but the last (never fed back in)
    assert done.stats.cached_tokens == len(first) + len(reply) - 1
    want, cold_done = run(cold, follow_up)
    assert cold_done.stats.cached_tokens == 0
    assert got == want
    assert done.text == cold_done.text


@pytest.mark.parametrize("model", ["tiny-laneformer", "tiny-qwen3"])
def test_conversations_in_turn_restore_their_slots(checkpoints, monkeypatch, model):
    warm, cold = engines(checkpoints[model], monkeypatch)
    vocab = warm.config.vocab_size
    a, b = ids(3, 80, vocab), ids(4, 70, vocab)
    a_reply, _ = run(warm, a)
    b_reply, _ = run(warm, b)  # overwrites the live cache: a's rows go into a slot first
    a_next = a + a_reply + ids(5, 12, vocab)
    got, done = run(warm, a_next)
    assert done.stats.cached_tokens == len(a) + len(a_reply) - 1
    assert got == run(cold, a_next)[0]
    b_next = b + b_reply + ids(6, 12, vocab)
    got, done = run(warm, b_next)  # b's rows were saved when a's follow-up came back
    assert done.stats.cached_tokens == len(b) + len(b_reply) - 1
    assert got == run(cold, b_next)[0]
    # a retry: the whole prompt is cached but its last id, whose logits give the first token
    again, done = run(warm, b_next)
    assert done.stats.cached_tokens == len(b_next) - 1
    assert again == got
    # a branch that shares part of a slot: those rows only
    branch = a[:50] + ids(7, 20, vocab)
    got, done = run(warm, branch)
    assert done.stats.cached_tokens == 50
    assert got == run(cold, branch)[0]


def test_a_sampled_follow_up_with_a_seed_draws_what_a_cold_start_draws(checkpoints, monkeypatch):
    warm, cold = engines(checkpoints["tiny-laneformer"], monkeypatch)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=11)
    first = ids(8, 60, warm.config.vocab_size)
    reply, _ = run(warm, first, params)
    follow_up = first + reply + ids(9, 10, warm.config.vocab_size)
    got, done = run(warm, follow_up, params)
    assert done.stats.cached_tokens > len(first)
    assert got == run(cold, follow_up, params)[0]


@pytest.mark.parametrize("model", FAMILIES)
@torch.no_grad()
def test_a_suffix_prefill_leaves_the_cold_prefills_logits_and_cache(checkpoints, model):
    """The same positions, the same cache contents: rows [0, n) and the last logits of a prefill from a reused
    prefix against one prefill of the whole (fp32: equal up to the order of the sums)."""
    engine = Engine.load(checkpoints[model], device="cpu")
    transformer, n, cut = engine.model, 100, 70
    prompt = torch.tensor([ids(10, n, engine.config.vocab_size)])
    cold, warm = (KVCache(engine.config, 128, 1, "cpu", torch.float32) for _ in range(2))
    want = transformer(prompt, 0, cold, last_only=True)
    transformer(prompt[:, :cut], 0, warm)  # an earlier request that shared the first `cut` ids
    got = transformer(prompt[:, cut:], cut, warm, last_only=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(warm.k[:, :, :, :n], cold.k[:, :, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(warm.v[:, :, :, :n], cold.v[:, :, :, :n], rtol=1e-5, atol=1e-5)


def tiny_cache() -> KVCache:
    cache = KVCache.__new__(KVCache)
    cache.k, cache.v, cache.max_len = torch.zeros(1, 1, 1, 16, 2), torch.zeros(1, 1, 1, 16, 2), 16
    return cache


def fill(cache: KVCache, ids: list[int], start: int) -> None:
    """What a request writes: each row holds its token's id."""
    for p in range(start, len(ids)):
        cache.k[:, :, :, p], cache.v[:, :, :, p] = ids[p], -ids[p]


def test_slots_keep_the_most_recent_and_restore_exact_rows():
    live = tiny_cache()
    prefix = PrefixCache(live, capacity=2)

    def request(seq: list[int]) -> int:
        start = prefix.begin(seq)
        fill(live, seq, start)
        prefix.written(seq)
        return start

    x, y, z, w = [1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12], [14, 15]
    assert request(x) == 0 and request(y) == 0
    assert [s.ids for s in prefix.slots] == [x]
    assert request(x + [13]) == 5  # restored from its slot, y saved first
    assert [s.ids for s in prefix.slots] == [y, x]
    assert request(z) == 0  # x + [13] saved over x's slot, which it extends
    assert [s.ids for s in prefix.slots] == [y, x + [13]]
    assert request(w) == 0  # z saved; y, the least recently used, goes
    assert [s.ids for s in prefix.slots] == [x + [13], z]
    live.k.zero_(), live.v.zero_()
    assert prefix.begin(x + [13]) == 5  # all of it but the last id, which is always prefilled again
    assert live.k[0, 0, 0, :5, 0].tolist() == x and live.v[0, 0, 0, :5, 0].tolist() == [-i for i in x]
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_no_slots_at_all_means_every_prompt_starts_cold(monkeypatch):
    monkeypatch.setenv("KOG_PREFIX_SLOTS", "0")
    prefix = PrefixCache.sized(tiny_cache())
    prefix.written([1, 2, 3])
    assert prefix.begin([1, 2, 3, 4]) == 0


def test_the_slot_setting_is_checked(monkeypatch):
    monkeypatch.setenv("KOG_PREFIX_SLOTS", "-1")
    with pytest.raises(ValueError, match="KOG_PREFIX_SLOTS"):
        PrefixCache.sized(tiny_cache())


def test_common_prefix_finds_the_first_difference_wherever_it_lies():
    rng = random.Random(3)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        expected = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        assert common_prefix(a, b) == expected == common_prefix(b, a)
