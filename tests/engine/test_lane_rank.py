"""The fast path's step for one rank of a Laneformer whose lanes live on several devices
(inference/fast/lane_rank.py): processes joined by peer mailboxes decode the one-process model's greedy tokens in
fp32, with the next logits, through the same kernels as the one-device runner plus the exchange's; and so do
Llama and Qwen models split as tensor parallelism (lanes summed at every block).

Without a GPU the processes share CPU memory and Triton's interpreter runs the kernels (two cases: it is slow);
with a GPU a process, every case. On the GPU machine (no Redis there):
    python -m pytest -q --noconftest tests/engine/test_lane_rank.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from inference.fast.lane_rank import fast_greedy_job
from inference.lanes_parallel import spawn_lanes
from inference.presets import PRESETS
from tests.engine.test_lanes_parallel import NEW_TOKENS, PROMPT, reference, tiny

# (lanes, delay, window, processes, config): each process count with early sums, early sums off, the norm of
# the lanes' sum, one to four lanes a rank, windows on and off
GPU_CASES = [
    (2, 1, None, 2, {}),
    (2, 2, 4, 2, {"use_early_comm": False}),
    (4, 2, 4, 2, {}),
    (4, 1, None, 2, {"pre_norm_lane_agg": True}),
    (8, 2, 4, 2, {}),
    (8, 1, 4, 2, {"pre_norm_lane_agg": True}),
    (4, 1, 4, 4, {}),
    (8, 2, None, 4, {"use_early_comm": False}),
    (8, 1, 4, 8, {}),
    (8, 2, 4, 8, {"pre_norm_lane_agg": True}),
]
# Processes sharing a device take turns on it, a wait holding it to the end of its turn: with a GPU a process the
# cases that fit; otherwise two (the interpreter is slow): early sums with a delay of 2 and windows, and the norm
# of the sum with two lanes a rank on four ranks.
CPU_CASES = [(4, 2, 4, 2, {}), (8, 1, None, 4, {"pre_norm_lane_agg": True})]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CASES = [case for case in GPU_CASES if case[3] <= GPUS] or CPU_CASES


@pytest.mark.slow
@pytest.mark.parametrize(("lanes", "delay", "window", "world", "extra"), CASES)
def test_rank_runners_decode_the_one_process_models_tokens(lanes, delay, window, world, extra):
    raw = tiny(lanes, delay, window, **extra)
    expected, expected_logits = reference(raw, seed=lanes + delay)
    job = functools.partial(fast_greedy_job, raw, lanes + delay, PROMPT, NEW_TOKENS, "peer")
    for tokens, logits in spawn_lanes(world, job, mode="peer"):
        assert tokens == expected
        torch.testing.assert_close(torch.tensor(logits), expected_logits, rtol=1e-4, atol=1e-4)


# Qwen2's q/k/v bias (two KV heads so that two ranks share them), Llama's tied head, Qwen3's q/k norms
TENSOR_PARALLEL = {
    "tiny-llama": PRESETS["tiny-llama"]["config"],
    "tiny-qwen2": {**PRESETS["tiny-qwen2"]["config"], "num_key_value_heads": 2},
    "tiny-qwen3": PRESETS["tiny-qwen3"]["config"],
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(TENSOR_PARALLEL) if GPUS >= 2 else ["tiny-qwen3"])
def test_rank_runners_of_a_llama_or_qwen_decode_the_one_process_models_tokens(preset):
    raw = TENSOR_PARALLEL[preset]
    expected, expected_logits = reference(raw, seed=6)
    job = functools.partial(fast_greedy_job, raw, 6, PROMPT, NEW_TOKENS, "peer")
    for tokens, logits in spawn_lanes(2, job, mode="peer"):
        assert tokens == expected
        torch.testing.assert_close(torch.tensor(logits), expected_logits, rtol=1e-4, atol=1e-4)
