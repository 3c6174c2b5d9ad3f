"""Decode timed on the device: a kernel or graph's median time, the fast runner's graph replays (the benchmark's
figure), and its runner contract as the engine drives it (greedy, or the page's sampling settings)."""

from __future__ import annotations

import statistics
import time

import torch

from common.events import SamplingParams, decode_tok_s


def median_ms(fn, repeats: int = 10, before=None) -> float:
    """Median milliseconds of fn() on the device, after one warm-up call. With `before`, each repeat first runs
    before() untimed (a cache flush, say), synchronizes, and keeps the GPU busy for ~1 ms while the launches are
    queued, so that the host's launch time of a single short kernel is not counted."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_fast(runner, prompt: list[int], new_tokens: int, runs: int) -> dict:
    """Prefill, then new_tokens - 1 back-to-back graph replays; medians over `runs` after one warm-up."""
    graph = runner.capture(greedy=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def one() -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.prefill(prompt)
        int(runner.token.item())
        ttft = (time.perf_counter() - t0) * 1e3
        start.record()
        for _ in range(new_tokens - 1):
            graph.replay()
        end.record()
        end.synchronize()
        return ttft, (new_tokens - 1) / (start.elapsed_time(end) / 1e3)

    one()
    results = [one() for _ in range(runs)]
    return {"ttft_ms": statistics.median(r[0] for r in results), "tok_s": statistics.median(r[1] for r in results),
            "tok_s_runs": [r[1] for r in results]}  # fmt: skip


# The playground page's default sampling settings (playground/views.py FORM_DEFAULTS), and the row
# that times them (scripts/gpu_check.sh finds it by SAMPLED_ROW_PREFIX).
PAGE_SAMPLING = {"temperature": 0.2, "top_p": 0.95}
SAMPLED_ROW_PREFIX = "fast, runner contract, sampled"
SAMPLED_ROW = (f"{SAMPLED_ROW_PREFIX} (temperature {PAGE_SAMPLING['temperature']}, top-p {PAGE_SAMPLING['top_p']}: "
               "the page's defaults)")  # fmt: skip


# The page's settings with the whole bf16 head, beside SAMPLED_ROW when that one reads the head through its screen.
PAGE_WHOLE_HEAD_ROW = "fast, runner contract, page sampling, full bf16 head"


def same_draws(runner, full_head, prompt: list[int], new_tokens: int, seeds: int = 4) -> float:
    """The share of tokens the runner draws under the page's settings that the whole-head runner draws too, over
    `seeds` requests of new_tokens each: up to the first difference of each (a difference changes the rest)."""
    same = 0
    for seed in range(seeds):
        params = SamplingParams(max_new_tokens=new_tokens, seed=seed, **PAGE_SAMPLING)
        pairs = zip(
            runner.generate_tokens(prompt, params), full_head.generate_tokens(prompt, params), strict=True
        )
        same += next((i for i, (a, b) in enumerate(pairs) if a != b), new_tokens)
    return same / (seeds * new_tokens)


def time_contract(runner, prompt: list[int], new_tokens: int, runs: int, **sampling) -> dict:
    """The engine's view: generate_tokens with its pinned-memory hand-off, decode tok/s from token times;
    greedy unless `sampling` gives SamplingParams' knobs."""
    params = SamplingParams(max_new_tokens=new_tokens, **sampling)

    def one() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        times = []
        for _ in runner.generate_tokens(prompt, params):
            times.append(time.perf_counter() - t0)
        return decode_tok_s(times)

    one()
    before = runner.sample_scratch.path_counts()
    result = {"tok_s": statistics.median(one() for _ in range(runs))}
    # which of kernels/sample.py's paths the timed steps took (none for greedy ones)
    after = runner.sample_scratch.path_counts()
    paths = {path: n - before[path] for path, n in after.items() if n > before[path]}
    if paths:
        result["sample_paths"] = paths
    if runner.screen_left_at is not None:  # the last request's flat logits sent it to the whole head
        result["left_screen_after"] = runner.screen_left_at - len(prompt)
    return result
