"""One of a FastRunner's buffers moved to a new address: whether a runner's decode
speed follows where that buffer lies. Runners of one setting, built from the same weights, differ by ~1% on an
H200 (docs/fast-path.md); a move that turns a slow runner fast (or back) names the buffer.

A move allocates the buffer afresh, `offset` bytes into a larger allocation, copies its values (the step reads
some of them: the packed words, the sums it cleared), re-points every view the step's launches read, and drops
the captured step and prompt graphs, which hold the old addresses. The runner then decodes exactly as before."""

from __future__ import annotations

import dataclasses

import torch

# what can move: the fp32 residual (the packed o-proj's and down-proj's atomics add into it), the packed
# kinds' fp32 sums and their norm's scalars, each packed kind's words, the KV cache (what the attention streams)
# and the attention's split-merge scratch (partials and counters)
PACKED_ATTRIBUTES = {"qkv": "wqkv_packed", "o": "wo_packed", "gate_up": "w13_packed", "down": "w2_packed"}
WORDS = tuple(f"words.{kind}" for kind in PACKED_ATTRIBUTES)
MOVABLE = ("residual", "sums", "norm_scalars", *WORDS, "cache", "scratch")


# Triton compiles a kernel apart for pointers that are not 16-byte aligned (and the packed launches read fp32
# buffers as int64): a move keeps that alignment, or it would time another kernel.
ALIGNMENT = 16


def relocated(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of the contiguous t that starts `offset` bytes (a multiple of ALIGNMENT) into a fresh allocation."""
    if offset < 0 or offset % ALIGNMENT:
        raise ValueError(f"offset: expected a non-negative multiple of {ALIGNMENT} bytes, got {offset}")
    start = offset // t.element_size()
    fresh = torch.empty(start + t.numel(), dtype=t.dtype, device=t.device)
    moved = fresh[start:].view(t.shape)
    moved.copy_(t)
    return moved


def move(runner, what: str, offset: int = 0) -> bool:
    """Moves the runner's `what` (one of MOVABLE) `offset` bytes into a fresh allocation; False where the runner
    has none (a kind it does not pack, sums without a packed gate/up or q|k|v)."""
    if what not in MOVABLE:
        raise ValueError(f"what: expected one of {', '.join(MOVABLE)}, got {what!r}")
    if what == "residual":
        runner.use_residual(relocated(runner.x, offset))
    elif what == "sums":
        if runner.sums is None:
            return False
        runner.sums = relocated(runner.sums, offset)
        qkv_rows = runner.qkv_sums.shape[1] if runner.qkv_sums is not None else 0
        if runner.qkv_sums is not None:
            runner.qkv_sums = runner.sums[:qkv_rows].view(1, qkv_rows)
        if runner.glu_sums is not None:
            runner.glu_sums = runner.sums[qkv_rows:]
    elif what == "cache":  # the step's launches take their layer's views of cache.k / cache.v as they launch
        runner.cache.k = relocated(runner.cache.k, offset)
        runner.cache.v = relocated(runner.cache.v, offset)
    elif what == "scratch":  # one per lane group, shared by reference: moved in place
        scratches = {id(each): each for each in [runner.attn_scratch, *(g.scratch for g in runner.groups)]}
        for scratch in scratches.values():
            # the counters are copied at zero, as every merge leaves them
            for name in ("part_o", "part_ml", "counter"):
                setattr(scratch, name, relocated(getattr(scratch, name), offset))
    elif what == "norm_scalars":
        scalars = [name for name in ("qkv_rstd", "glu_rstd") if getattr(runner, name) is not None]
        if not scalars:
            return False
        for name in scalars:
            setattr(runner, name, relocated(getattr(runner, name), offset))
    else:
        attribute = PACKED_ATTRIBUTES[what.removeprefix("words.")]
        layers = [w for w in runner.layers if getattr(w, attribute) is not None]
        if not layers:
            return False
        for w in layers:
            packed = getattr(w, attribute)
            setattr(w, attribute, dataclasses.replace(packed, lo=relocated(packed.lo, offset),
                                                      codes=relocated(packed.codes, offset)))  # fmt: skip
    runner.graphs.clear()
    runner.prefill_graphs.clear()  # the prompt's graphs write the cache and the residual too
    return True
