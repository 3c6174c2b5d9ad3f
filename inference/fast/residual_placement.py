"""Where a runner's residual stream lies: one measured step, FastRunner.place_residual(), which the engine calls
once on a GPU (docs/fast-path.md).

The packed o-proj's and down-proj's programs add their rows into the residual x with atomics (qwen3-1.7b: 3,072
down-proj programs a layer, each adding 16 rows of the 2,048), and the L2 performs each atomic in the slice that
holds its line. Which slices hold x's lines follows its physical address, which a program cannot see or choose.
The same runner with x moved to another allocation gets faster or slower in the down-proj alone, and keeps that
speed for as long as x stays; some addresses slow the whole step (docs/fast-path.md). So the runner times its
greedy step with x at a few candidate addresses and keeps the fastest: a measured choice, like a kernel's
autotuned blocks, made once when the model loads.
"""

from __future__ import annotations

import statistics
import time

import torch

CANDIDATES = 8  # addresses timed: enough that one of them is very likely among the fast four in five
# Bytes between two candidates: past any 64 KiB boundary (a move of 64 KiB already changes the down-proj's time),
# and not a power of two, so the candidates differ in many address bits.
CANDIDATE_STRIDE = 64 * 1024 + 4 * 1024 + 512


def residual_pool(x: torch.Tensor, candidates: int) -> list[torch.Tensor]:
    """`candidates` views shaped like x, CANDIDATE_STRIDE bytes apart (plus x's own bytes) in one allocation,
    16-byte aligned as the packed launches need (they read fp32 buffers as int64)."""
    if candidates < 1:
        raise ValueError(f"candidates: expected at least 1, got {candidates}")
    stride = (x.numel() * x.element_size() + CANDIDATE_STRIDE) // x.element_size()
    pool = torch.zeros(candidates * stride, dtype=x.dtype, device=x.device)
    return [pool[k * stride : k * stride + x.numel()].view(x.shape) for k in range(candidates)]


def step_seconds(runner, position: int, replays: int, repeats: int) -> float:
    """The median over `repeats` of the mean time of one greedy step, over `replays` steps from `position`: a CUDA
    graph's replays between device events on a GPU (after a warm-up replay), eager steps by the host's clock
    elsewhere (the tests)."""
    if runner.device.type != "cuda":
        times = []
        for _ in range(repeats):
            runner.pos.fill_(position)
            began = time.perf_counter()
            for _ in range(replays):
                runner.decode_step(greedy=True)
            times.append((time.perf_counter() - began) / replays)
        return statistics.median(times)
    graph = runner.capture(greedy=True)
    runner.pos.fill_(position)
    graph.replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        runner.pos.fill_(position)  # each repeat's steps read and write the same cache rows
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    return statistics.median(times)


@torch.no_grad()
def place_residual(
    runner, candidates: int, replays: int | None = None, repeats: int | None = None
) -> list[float]:
    """Times the runner's greedy step with its residual at each of `candidates` addresses and leaves it at the
    fastest. Returns each candidate's step time in seconds, in candidate order (runner.residual_choice: the kept
    one's index). The step's state (token, position, outputs) is left as it was; the KV cache rows from about the
    middle of the context hold the timing's keys, which a request's own steps write before they read them."""
    on_gpu = runner.device.type == "cuda"
    # on a GPU 3 x 32 steps a candidate (enough to tell the addresses apart), and a capture; one eager step elsewhere
    replays, repeats = replays or (32 if on_gpu else 1), repeats or (3 if on_gpu else 1)
    # the steps from about the middle of the context, as a request's decode would take them
    position = max(0, runner.max_context // 2 - replays)
    replays = max(1, min(replays, runner.max_context - 2 - position))
    pool = residual_pool(runner.x, candidates)
    seconds = []
    with runner.step_state_kept():
        runner.token.zero_()
        for x in pool:
            runner.use_residual(x)
            seconds.append(step_seconds(runner, position, replays, repeats))
    runner.residual_choice = min(range(candidates), key=seconds.__getitem__)
    runner.use_residual(pool[runner.residual_choice])
    return seconds
