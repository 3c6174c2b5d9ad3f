"""Where a step's and a prefill's GPU time goes, from torch.profiler: the --breakdown (time per kernel of the
captured decode step against the bytes it must read) and the --prefill-profile (GPU time by kernel, timeline)."""

from __future__ import annotations

import statistics

import torch

from inference.bench.ceiling import kernel_bytes
from inference.model import Transformer


def breakdown(model: Transformer, runner, prompt: list[int], replays: int, read_gbs: float) -> dict:
    """Per kind of kernel: time on the step's critical path (end to end of consecutive kernels, so PDL
    overlap is not counted twice) and the bytes it must read."""
    from torch.profiler import ProfilerActivity, profile

    cfg = model.cfg
    graph = runner.capture(greedy=True)
    runner.prefill(prompt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "_kernel" in e.name),
        key=lambda e: e.time_range.start,
    )
    expected = kernel_bytes(cfg, model.tok_embeddings.element_size(), len(prompt) + replays // 2,
                            runner.head_screen is not None, runner.packed_bytes())  # fmt: skip
    per_step = len(expected)
    if len(kernels) < per_step * replays:
        return {"error": f"profiler saw {len(kernels)} kernels, expected {per_step * replays}"}
    kinds: dict[str, dict] = {}
    step_spans = []
    for s in range(replays):
        step = kernels[s * per_step : (s + 1) * per_step]
        step_spans.append(step[-1].time_range.end - step[0].time_range.start)
        prev_end = step[0].time_range.start
        for e, (kind, nbytes) in zip(step, expected, strict=True):
            k = kinds.setdefault(kind, {"count": 0, "busy_us": 0.0, "path_us": 0.0, "bytes": 0})
            k["count"] += 1
            k["busy_us"] += e.time_range.end - e.time_range.start
            k["path_us"] += max(0.0, e.time_range.end - max(prev_end, e.time_range.start))
            k["bytes"] += nbytes
            prev_end = max(prev_end, e.time_range.end)
    for k in kinds.values():
        for field in ("busy_us", "path_us", "bytes"):
            k[field] /= replays
        k["count"] //= replays
        k["gbs"] = k["bytes"] / k["path_us"] / 1e3 if k["path_us"] else 0.0
        k["pct_of_read_bw"] = 100 * k["gbs"] / read_gbs
        k["ideal_us"] = k["bytes"] / read_gbs / 1e3
    return {"kinds": kinds, "kernels_per_step": per_step, "step_span_us": statistics.median(step_spans)}


def profiled_prefill(runner, prompt: list[int]):
    """torch.profiler's record (host and GPU) of one prefill up to its first token on the host, after a warm-up;
    the host range is named "prefill to first token"."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner.prefill(prompt)
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof, record_function("prefill to first token"):
        runner.prefill(prompt)
        int(runner.token.item())
    return prof


def prefill_profile(runner, prompt: list[int], top: int = 14) -> dict:
    """GPU time of one prefill by kernel name (after a warm-up), largest first: where the TTFT goes. Also the
    timeline of that prefill (call to first token on the host): how long until the GPU's first kernel starts,
    the GPU idle between kernels, and the host's tail after the last one. The first of these holds ~2 ms that
    the profiler itself adds at the first CUDA call it sees: untraced, the GPU's
    span is the TTFT."""
    prof = profiled_prefill(runner, prompt)
    per_name: dict[str, list] = {}
    spans, wall = [], None
    for e in prof.events():
        if e.name == "prefill to first token":  # the host range (its GPU-side annotation is no kernel)
            if e.device_type != torch.autograd.DeviceType.CUDA:
                wall = (e.time_range.start, e.time_range.end)
        elif e.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
            spans.append((e.time_range.start, e.time_range.end))
    ranked = sorted(per_name.items(), key=lambda item: -item[1][1])
    out = {"gpu_ms": sum(t for _, (_, t) in ranked) / 1e3,
           "kernels": [{"name": n, "calls": c, "ms": t / 1e3} for n, (c, t) in ranked[:top]]}  # fmt: skip
    if wall and spans:
        spans.sort()
        idle, reach = 0.0, spans[0][0]
        for start, end in spans:  # GPU idle between kernels (overlapping kernels count once)
            idle += max(0.0, start - reach)
            reach = max(reach, end)
        out["timeline_ms"] = {"wall": (wall[1] - wall[0]) / 1e3, "before_first_kernel": (spans[0][0] - wall[0]) / 1e3,
                              "gpu_idle_between": idle / 1e3, "after_last_kernel": (wall[1] - reach) / 1e3}  # fmt: skip
    return out
