"""Prefix reuse on the fast runner (its kernels under Triton's interpreter on the CPU): a prefill from a reused
prefix leaves the logits a cold prefill of the whole prompt leaves, and generates the same tokens, with sliding
windows, the Laneformer's delayed reductions and lane groups."""

import random
from dataclasses import replace

import pytest
import torch

from common.events import Done, SamplingParams
from inference.config import ModelConfig
from inference.engine import Engine
from inference.fast.runner import FastRunner
from inference.fast.settings import RunnerSettings
from inference.model import Transformer
from inference.presets import preset_config
from tests.support.kernels import DEVICE, ON_GPU

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
GREEDY = SamplingParams(max_new_tokens=5)


def model_of(preset: str) -> Transformer:
    model = Transformer(ModelConfig.from_hf(preset_config(preset)), device=DEVICE, dtype=DTYPE)
    model.init_weights(std=0.05, generator=torch.Generator(device=DEVICE).manual_seed(0))
    return model.eval()


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.mark.parametrize(
    "preset,kwargs",
    [
        ("tiny-laneformer", {}),  # windows of 64, reductions delayed by 2 layers
        ("tiny-laneformer", {"lane_groups": 2}),
        ("tiny-qwen3", {}),
        ("tiny-qwen2", {}),
    ],
)
@torch.no_grad()
def test_a_follow_up_from_a_reused_prefix_matches_a_cold_prefill(preset, kwargs):
    model = model_of(preset)
    settings = replace(RunnerSettings.resolve(model.cfg, DEVICE, DTYPE), **kwargs)
    warm, cold = FastRunner(model, 160, settings=settings), FastRunner(model, 160, settings=settings)
    first = ids(1, 75)  # past the 64-token window
    reply = list(warm.generate_tokens(first, GREEDY))
    follow_up = first + reply + ids(2, 9)
    start = len(first) + len(reply) - 1  # rows the first request wrote: its last token was never fed back
    got = list(warm.generate_tokens(follow_up, GREEDY, start=start))
    want = list(cold.generate_tokens(follow_up, GREEDY))
    assert got == want
    # the prefill's own logits: a suffix of 9 + 1 rows against the whole prompt
    warm.prefill(follow_up, start=start)
    cold.prefill(follow_up)
    rel = (warm.logits.double() - cold.logits.double()).norm() / cold.logits.double().norm()
    assert rel < (2e-2 if ON_GPU else 1e-4)
    n = len(follow_up)
    # bf16 on the GPU: cuBLAS may round a 10-row product and a 200-row one differently, by one ulp
    tolerance = 1.6e-2 if ON_GPU else 1e-4
    torch.testing.assert_close(
        warm.cache.k[:, :, :, :n], cold.cache.k[:, :, :, :n], rtol=tolerance, atol=tolerance
    )


def test_the_engine_on_the_fast_runner_reuses_prefixes(monkeypatch):
    monkeypatch.setenv("KOG_BACKEND", "fast")
    engine = Engine.load("tiny-laneformer", device=str(DEVICE))
    monkeypatch.setenv("KOG_PREFIX_SLOTS", "0")
    cold = Engine.load("tiny-laneformer", device=str(DEVICE))

    def run(e: Engine, prompt: list[int]) -> tuple[list[int], Done]:
        events = list(e.generate(prompt, GREEDY))
        return [t for ev in events[:-1] for t in getattr(ev, "token_ids", [])], events[-1]

    a, b = ids(3, 40), ids(4, 30)
    a_reply, _ = run(engine, a)
    run(engine, b)  # a's rows go into a slot
    follow_up = a + a_reply + ids(5, 6)
    got, done = run(engine, follow_up)
    assert done.stats.cached_tokens == len(a) + len(a_reply) - 1
    assert got == run(cold, follow_up)[0]
