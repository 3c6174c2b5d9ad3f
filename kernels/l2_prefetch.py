"""Weights of a later kernel requested into L2 while this one leaves the memory idle (Hopper's bulk prefetch).

At batch 1 the memory is idle whenever the step waits on a chain of small dependent trips: attention's
q -> scores -> partials -> merge, and the ramp and tail of every kernel boundary. A kernel can spend that
time asking for the bytes a later kernel will read: `cp.async.bulk.prefetch.L2.global` moves a range from
HBM into L2 without registers, shared memory or waiting, so the kernel that later reads them finds L2 hits.

A region is (tensor, byte offset, bytes). The programs of the issuing kernel split it evenly, and each
thread of a program asks for one contiguous piece (16-byte multiples, as the instruction requires).
The interpreter has no inline assembly, so there the regions are dropped: prefetching never changes a
result, only where the bytes come from.
"""

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels import interpreted

MAX_REGIONS = 2
ALIGN = 16  # bytes: the bulk prefetch's address and size granularity
# KOG_L2_LINES=1: per-thread prefetch.global.L2::evict_last every 128 bytes instead of the bulk prefetch (read
# at import; for experiments).
LINES = tl.constexpr(os.environ.get("KOG_L2_LINES", "0") == "1")
LINE = tl.constexpr(128)


@triton.jit
def _line_prefetch(base_ptr, byte_offset, nbytes, pid, programs, THREADS: tl.constexpr):
    """The same share, one prefetch.global.L2::evict_last a 128-byte line and thread at a time."""
    share = tl.cdiv(tl.cdiv(nbytes, programs), LINE * THREADS) * LINE * THREADS
    first = pid.to(tl.int64) * share + tl.arange(0, THREADS).to(tl.int64) * LINE  # [THREADS]
    base = base_ptr.to(tl.pointer_type(tl.int8)) + byte_offset
    for step in range(0, share, LINE * THREADS):
        offs = first + step
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
            "=r,l,r",
            [base + offs, (offs < nbytes).to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def l2_prefetch(base_ptr, byte_offset, nbytes, pid, programs, THREADS: tl.constexpr):
    """Program `pid` of `programs` requests its share of bytes [byte_offset, byte_offset + nbytes) of base_ptr
    into L2; THREADS pieces a program (one per thread when THREADS = 32 * num_warps)."""
    if LINES:
        _line_prefetch(base_ptr, byte_offset, nbytes, pid, programs, THREADS)
        return
    share = tl.cdiv(tl.cdiv(nbytes, programs), 16 * THREADS) * 16 * THREADS
    piece = share // THREADS
    start = pid.to(tl.int64) * share + tl.arange(0, THREADS).to(tl.int64) * piece  # [THREADS]
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    addr = base_ptr.to(tl.pointer_type(tl.int8)) + byte_offset + start
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def l2_prefetch_regions(p0, off0, bytes0, p1, off1, bytes1, pid, programs, REGIONS: tl.constexpr,
                        THREADS: tl.constexpr):  # fmt: skip
    """l2_prefetch of the live ones of two regions (prefetch_args' order)."""
    if REGIONS > 0:
        l2_prefetch(p0, off0, bytes0, pid, programs, THREADS)
    if REGIONS > 1:
        l2_prefetch(p1, off1, bytes1, pid, programs, THREADS)


Region = tuple[torch.Tensor, int, int]  # (tensor, byte offset, bytes)


def region(t: torch.Tensor, start: int, nbytes: int) -> Region:
    """Bytes [start, start + nbytes) of t, clipped to it and aligned down to 16 bytes (empty if nothing is
    left)."""
    total = t.numel() * t.element_size()
    start = min(max(start, 0), total) // ALIGN * ALIGN
    nbytes = max(0, min(nbytes, total - start)) // ALIGN * ALIGN
    return t, start, nbytes


def prefetch_args(regions: Sequence[Region] | None, fallback: torch.Tensor) -> tuple[list, int]:
    """The kernel arguments of up to MAX_REGIONS regions (pointer, offset, bytes each; unused slots point at
    `fallback` with 0 bytes) and how many are live. Empty regions are dropped, and all of them under the
    interpreter (after the checks, so that bad regions fail there too)."""
    live = [r for r in regions or () if r[2] > 0]
    if len(live) > MAX_REGIONS:
        raise ValueError(f"l2_prefetch: at most {MAX_REGIONS} regions, got {len(live)}")
    for t, start, nbytes in live:
        if t.device != fallback.device:
            raise ValueError(f"l2_prefetch: a region on {t.device}, expected {fallback.device}")
        if start % ALIGN or nbytes % ALIGN or t.data_ptr() % ALIGN:
            raise ValueError(f"l2_prefetch: offsets, sizes and addresses must be {ALIGN}-byte aligned, "
                             f"got offset {start}, {nbytes} bytes")  # fmt: skip
        if start + nbytes > t.numel() * t.element_size():
            raise ValueError(f"l2_prefetch: bytes [{start}, {start + nbytes}) lie past the tensor's end")
    if interpreted():
        live = []
    padded = live + [(fallback, 0, 0)] * (MAX_REGIONS - len(live))
    return [value for r in padded for value in r], len(live)
