"""The gate/up of a one-lane model's MLP on the tensor cores from 12-bit weights, SiLU and all, in one launch:

    h[f] = silu(rstd * (W_gate[f] @ (x * g))) * (rstd * (W_up[f] @ (x * g))),   rstd = 1 / sqrt(mean(x ** 2) + eps)

    x: [K] the fp32 residual; g: [K] bf16 the MLP's norm weight; h: [F] bf16 (rounded as a bf16 model rounds its
    activations) or fp32

The weights are kernels/packed_mma_gemv.py's layout of the two matrices interleaved by 8 rows (interleave_glu):
M-tile m holds gate rows 8m .. 8m + 7, then up rows 8m .. 8m + 7. The mma puts a tile's rows g and g + 8 in the
same lane (D's slots 0-1 and 2-3), so each lane of 0, 4, ..., 28 ends with a gate sum and its up sum side by side,
and the program writes h for its 8 rows itself: no sums in memory for a later launch, nothing to clear, and the
down-proj reads h as it reads the bf16 kernel's.

A program takes BM M-tiles, a warp each, over the whole of K (rstd needs all of x, and the SiLU the whole sums),
every warp walking the same chunks. B is x * g split into a bf16 hi and lo part, built one pair a lane and gathered
into the slots (warp shuffles) as packed_mma_gemv's NORMED inputs are, with the hi parts in B's column 0 and the lo
parts in its column 1: one mma a K-part, D's columns 0 and 1 summed at the end. The sum of x ** 2 comes from the
same loads. A program's chain is the whole of K, so both its weights (AHEAD chunks, BEFORE of them before the
wait) and its input (XAHEAD chunks, after it) are loaded ahead of their use, in rings that a loop (not unrolled)
carries from one chunk to the next. The M-tiles' exceptions are added to
their sums before the SiLU.

Under Triton's interpreter (no inline asm) the decoded weights' products are summed in fp32 in the mma's place,
as packed_mma_gemv does: the tests check the layout, the decode and the exceptions on the CPU, the mma on the GPU.

On an H200 (docs/fast-path.md) the unrolled form of this loop read its 1.5 bytes a weight at up to ~85%
of the bandwidth with 12-16 chunks loaded before its wait, but those loads slowed the o-proj it overlaps by about
as much: qwen3-1.7b 1,086 tok/s against 1,095 with the bf16 gate/up, so it is not the default (KOG_PACKED's kind
`glu`). Its SASS showed why a deep ring was needed before the wait: ptxas moved the unrolled ring's later loads
down to a few chunks before their use. The loop keeps the ring (SASS: a chunk's 3 loads, then its 4 mma, an
iteration) and lets BEFORE be small; not yet timed.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs
from kernels.packed_gemv import high_half, low_half
from kernels.packed_mma_gemv import (
    CHUNK,
    EXC_BLOCK,
    MMA4,
    NORMED,
    MmaPackedWeight,
    bf16_rounded,
    chunk_loads,
    exact_values,
    exception_terms,
    fragments,
    hi_lo_pairs,
    program_tiles,
    split_pair,
)


def interleave_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [F, K] -> [2F, K], by 8 rows: gate rows 8m .. 8m + 7, then up rows 8m .. 8m + 7 (F % 8 == 0)."""
    f, k = gate.shape
    if up.shape != gate.shape or f % 8:
        raise ValueError(f"gate, up: expected two [F, K] matrices with F a multiple of 8, got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")  # fmt: skip
    return torch.stack([gate.view(f // 8, 8, k), up.view(f // 8, 8, k)], dim=1).reshape(2 * f, k)


@triton.jit
def input_loads(x_ptr, norm_ptr, chunk):
    """A chunk's raw input, one pair a lane ([32]: pair p is columns 2p and 2p + 1 of the chunk): x's int64 words
    and g's bf16 pairs. Loaded XAHEAD chunks before their use: the residual is only ready after the wait, and a
    load at its use would put an L2 round trip into each chunk's step of a program that walks the whole of K."""
    pair = chunk * 32 + tl.arange(0, 32)
    return tl.load(x_ptr + pair), tl.load(norm_ptr + pair)


@triton.jit
def chunk_step(x_ptr, norm_ptr, words, x_words, g_pairs, base, zero_m, i, acc, acc_8, sumsq, t, j,
               K: tl.constexpr, USE_MMA: tl.constexpr):  # fmt: skip
    """Chunk i of the program's M-tiles ([BM, 128] words) against x * g's chunk (x_words [32] int64, g_pairs [32]
    int32, one pair a lane) into the sums: acc (the mma's D; under the interpreter rows g's sums, acc_8 rows
    g + 8's) and sumsq (x ** 2 by lane). zero_m [BM, 1] broadcasts a chunk's [128] B words over the M-tiles."""
    c = tl.arange(0, 128)
    first, second = split_pair(x_words)
    sumsq += first * first + second * second
    a = fragments(words, base, USE_MMA)
    if USE_MMA:
        # B's column 0 (lanes 0-3) holds x * g's bf16 hi parts, column 1 (lanes 4-7) the lo parts, the other
        # columns zeros: one mma a K-part (not one for each part), so each chunk's chain of dependent mma on the
        # accumulator is 4 long; D's columns 0 and 1 are the two parts' sums.
        hi, lo = hi_lo_pairs(first * low_half(g_pairs), second * high_half(g_pairs))  # [32] each
        b0 = tl.where(c < 16, tl.gather(hi, c % 16, 0), tl.where(c < 32, tl.gather(lo, c % 16, 0), 0))
        b1 = tl.where(
            c < 16, tl.gather(hi, c % 16 + 16, 0), tl.where(c < 32, tl.gather(lo, c % 16 + 16, 0), 0)
        )
        acc = tl.inline_asm_elementwise(MMA4, "=&f,=&f,=&f,=&f," + "r," * 24 + "f,f,f,f",
                                        [a[0], a[1], a[2], a[3], b0[None, :] + zero_m, b1[None, :] + zero_m, acc],
                                        dtype=tl.float32, is_pure=True, pack=4)  # fmt: skip
    else:
        pair = (i * 32 + 4 * t + j)[None, :] + zero_m  # [BM, 128]
        every = pair >= 0
        x0, x1 = exact_values(x_ptr, norm_ptr, pair, every, 1.0, NORMED, K)
        x8, x9 = exact_values(x_ptr, norm_ptr, pair + 16, every, 1.0, NORMED, K)
        acc += low_half(a[0]) * x0 + high_half(a[0]) * x1 + low_half(a[2]) * x8 + high_half(a[2]) * x9
        acc_8 += low_half(a[1]) * x0 + high_half(a[1]) * x1 + low_half(a[3]) * x8 + high_half(a[3]) * x9
    return acc, acc_8, sumsq


@triton.jit
def _packed_mma_glu_kernel(x_ptr, norm_ptr, lo_ptr, code_ptr, base_ptr, exc_start_ptr, exc_row_ptr, exc_col_ptr,
                           exc_value_ptr, out_ptr, eps, K: tl.constexpr, BM: tl.constexpr, BEFORE: tl.constexpr,
                           AHEAD: tl.constexpr, XAHEAD: tl.constexpr, EXC_BLOCK: tl.constexpr, EXC_ROUNDS: tl.constexpr,
                           ROUND_BF16: tl.constexpr, USE_MMA: tl.constexpr, USE_PDL: tl.constexpr,
                           TRIGGER_EARLY: tl.constexpr):  # fmt: skip
    CHUNKS: tl.constexpr = K // 64
    # BM M-tiles, a warp each ([BM, 128] tiles: row r is M-tile m[r]), every warp over the same chunks of K
    k0, m, g, t, j, tile, code_tile = program_tiles(K, BM, 1)
    base = tl.load(base_ptr + m[:, None] * 8 + g[None, :])  # [BM, 128]
    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    # The weights do not depend on the previous kernel: the first BEFORE chunks are in flight before its wait
    # (it overlaps them with the previous kernel's loads), the ring grows to AHEAD after it.
    ring = ()
    for f in tl.static_range(BEFORE):
        ring = ring + (chunk_loads(lo_ptr, code_ptr, tile, code_tile, f),)
    exc_first = tl.load(exc_start_ptr + tl.program_id(0) * BM)
    exc_end = tl.load(exc_start_ptr + tl.program_id(0) * BM + BM)
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()
    for f in tl.static_range(BEFORE, AHEAD):
        ring = ring + (chunk_loads(lo_ptr, code_ptr, tile, code_tile, f),)
    inputs = ()
    for f in tl.static_range(XAHEAD):
        inputs = inputs + (input_loads(x_ptr, norm_ptr, f),)

    acc = tl.zeros([BM, 128], dtype=tl.float32) + (base * 0).to(tl.float32)  # the mma's D, or rows g's sums
    acc_8 = acc  # the interpreter's sums of rows g + 8
    sumsq = tl.zeros([32], dtype=tl.float32)
    zero_m = (m * 0)[:, None]  # [BM, 1]
    # The steady state is a loop, not unrolled: its carried rings are the loads in flight. Unrolled, ptxas moved
    # the ring's loads after the wait down to a few chunks before their use (SASS read here, round 36).
    LEAD: tl.constexpr = AHEAD if AHEAD > XAHEAD else XAHEAD
    for i in range(CHUNKS - LEAD):
        words = ring[0]
        ring = ring[1:] + (
            chunk_loads(lo_ptr, code_ptr, tile + (i + AHEAD) * 256, code_tile + (i + AHEAD) * 128, 0),
        )
        x_words, g_pairs = inputs[0]
        inputs = inputs[1:] + (input_loads(x_ptr, norm_ptr, i + XAHEAD),)
        acc, acc_8, sumsq = chunk_step(x_ptr, norm_ptr, words, x_words, g_pairs, base, zero_m, i, acc, acc_8, sumsq, t, j,
                                       K, USE_MMA)  # fmt: skip
    for i in tl.static_range(CHUNKS - LEAD, CHUNKS):  # the last LEAD chunks: what is left in the rings
        words = ring[0]
        ring = ring[1:]
        if i + AHEAD < CHUNKS:
            ring = ring + (chunk_loads(lo_ptr, code_ptr, tile, code_tile, i + AHEAD),)
        x_words, g_pairs = inputs[0]
        inputs = inputs[1:]
        if i + XAHEAD < CHUNKS:
            inputs = inputs + (input_loads(x_ptr, norm_ptr, i + XAHEAD),)
        acc, acc_8, sumsq = chunk_step(x_ptr, norm_ptr, words, x_words, g_pairs, base, zero_m, i, acc, acc_8, sumsq, t, j,
                                       K, USE_MMA)  # fmt: skip

    c = tl.arange(0, 128)
    # Each M-tile's 8 gate sums and 8 up sums: [BM, 8] each, row g of each half. The mma's: D's columns 0 and 1,
    # slots 0, 1 (row g: gate) and 2, 3 (row g + 8: up) of lanes 0, 4, ..., 28.
    if USE_MMA:
        gate = tl.sum(tl.reshape(tl.where(c % 16 < 2, acc, 0.0), [BM, 8, 16]), axis=2)
        up = tl.sum(tl.reshape(tl.where((c % 16 >= 2) & (c % 16 < 4), acc, 0.0), [BM, 8, 16]), axis=2)
    else:  # row g's terms are the 16 words c of 16 g .. 16 g + 15
        gate = tl.sum(tl.reshape(acc, [BM, 8, 16]), axis=2)
        up = tl.sum(tl.reshape(acc_8, [BM, 8, 16]), axis=2)

    # The M-tiles' exceptions: true weight * B[col] less the floor's product, which the mma summed (a power of
    # two: that product is exact), each into its row's sum.
    rows = m[:, None] * 16 + tl.arange(0, 8)[None, :]  # [BM, 8]: the gate rows of the interleaved matrix
    for r in tl.static_range(EXC_ROUNDS):
        idx = exc_first + r * EXC_BLOCK + tl.arange(0, EXC_BLOCK)
        ok = idx < exc_end
        row, term = exception_terms(exc_row_ptr, exc_col_ptr, exc_value_ptr, base_ptr, x_ptr, norm_ptr, idx, ok,
                                    1.0, NORMED, K)  # fmt: skip
        term = term[:, None, None]  # [EXC_BLOCK, 1, 1]
        gate += tl.sum(tl.where(row[:, None, None] == rows[None, :, :], term, 0.0), axis=0)
        up += tl.sum(tl.where(row[:, None, None] == rows[None, :, :] + 8, term, 0.0), axis=0)

    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps)
    gate = gate * rstd
    h = gate * tl.sigmoid(gate) * (up * rstd)
    if ROUND_BF16:  # the bits a bf16 model's activations hold, under the interpreter too
        h = bf16_rounded(h)
    tl.store(out_ptr + m[:, None] * 8 + tl.arange(0, 8)[None, :], h.to(out_ptr.dtype.element_ty))


def packed_mma_glu(x: torch.Tensor, norm_weight: torch.Tensor, packed: MmaPackedWeight, out: torch.Tensor, *,
                   eps: float = 1e-6, block_m: int = 2, ahead: int = 4, before: int | None = None, x_ahead: int = 4,
                   use_pdl: bool = False, trigger_early: bool = False) -> torch.Tensor:  # fmt: skip
    """out = silu(rstd * W_gate @ (x * g)) * (rstd * W_up @ (x * g)) (the module docstring), W the packed
    interleave_glu of the two [F, K] matrices.

    x: [K] fp32 contiguous; norm_weight: [K] bf16; out: [F] bf16 or fp32 contiguous. block_m: M-tiles (warps) a
    program (a power of two dividing the 2F / 16 tiles); ahead: weight chunks a warp keeps in flight; before: how
    many of them it loads before it waits on the previous kernel (None: all `ahead`); x_ahead: the input's chunks
    it keeps in flight after the wait."""
    n, k = packed.shape
    if x.shape != (k,) or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(
            f"x: expected a contiguous [{k}] fp32 (the residual), got {x.dtype} {tuple(x.shape)}"
        )
    if norm_weight.shape != (k,) or norm_weight.dtype != torch.bfloat16 or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight: expected a contiguous [{k}] bf16, got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    if out.shape != (n // 2,) or out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous():
        raise ValueError(
            f"out: expected a contiguous [{n // 2}] bf16 or fp32, got {out.dtype} {tuple(out.shape)}"
        )
    tiles, chunks = n // 16, k // CHUNK
    if block_m < 1 or block_m & (block_m - 1) or tiles % block_m:
        raise ValueError(f"block_m: {block_m} is not a power of two dividing the {tiles} M-tiles")
    if ahead < 1 or x_ahead < 1:
        raise ValueError(f"ahead, x_ahead: expected at least 1 chunk each, got {ahead} and {x_ahead}")
    if before is not None and before < 0:
        raise ValueError(f"before: expected 0 chunks or more (None: all `ahead`), got {before}")
    ahead = min(ahead, chunks)  # a short K: all of it
    before = ahead if before is None else min(before, ahead)
    _packed_mma_glu_kernel[(tiles // block_m,)](
        x.view(torch.int64), norm_weight.view(torch.int32), packed.lo, packed.codes, packed.base, packed.exc_start,
        packed.exc_row, packed.exc_col, packed.exc_value, out, eps, K=k, BM=block_m, BEFORE=before, AHEAD=ahead,
        XAHEAD=min(x_ahead, chunks), EXC_BLOCK=EXC_BLOCK, EXC_ROUNDS=packed.exception_rounds(block_m, 1),
        ROUND_BF16=out.dtype == torch.bfloat16, USE_MMA=not interpreted(), USE_PDL=use_pdl,
        TRIGGER_EARLY=trigger_early, num_warps=block_m, num_stages=1, **pdl_kwargs(use_pdl),
    )  # fmt: skip
    return out
