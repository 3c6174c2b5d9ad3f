"""A Laneformer's lanes divided among processes that exchange their partials through peer mailboxes
(inference/lanes_exchange.py: rows written into each other's memory, flags raised and waited on by kernels).

With a GPU the processes share it (CUDA IPC, compiled kernels: the transport that peer access extends to several
GPUs); without one they share CPU memory and Triton's interpreter runs the same kernels. Either way the greedy
tokens and the next logits equal the one-process model's in fp32. On the GPU machine (no Redis there):
    python -m pytest -q --noconftest tests/engine/test_lanes_peer.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from inference.lanes_parallel import greedy_job, spawn_lanes
from tests.engine.test_lanes_parallel import NEW_TOKENS, PROMPT, reference, tiny

ON_GPU = torch.cuda.is_available()

GPU_CASES = [
    (lanes, delay, window, world)
    for lanes in (2, 4, 8)
    for delay in (1, 2)
    for window in (None, 4)
    for world in (2, 4)
    if lanes % world == 0
]
CPU_CASES = [(4, 2, 4, 2), (8, 1, None, 4)]  # the interpreter is slow: two of them
# Processes sharing a GPU take turns on it (time-slicing), a mailbox wait holding it to the end of its turn, so a
# case is slow there: with a GPU a process all the cases, else the CPU's two (a window and both delays still).
CASES = GPU_CASES if ON_GPU and torch.cuda.device_count() >= max(c[3] for c in GPU_CASES) else CPU_CASES


@pytest.mark.slow
@pytest.mark.parametrize(("lanes", "delay", "window", "world"), CASES)
def test_processes_joined_by_peer_mailboxes_decode_the_one_process_models_tokens(lanes, delay, window, world):
    raw = tiny(lanes, delay, window)
    expected, expected_logits = reference(raw, seed=lanes + delay)
    # a prefill piece of 5 rows: the 12-token prompt crosses the mailbox in three pieces
    job = functools.partial(greedy_job, raw, lanes + delay, PROMPT, NEW_TOKENS, "peer", chunk=5)
    for tokens, logits in spawn_lanes(world, job, mode="peer"):
        assert tokens == expected
        torch.testing.assert_close(torch.tensor(logits), expected_logits, rtol=1e-4, atol=1e-4)
