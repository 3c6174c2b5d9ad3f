"""The gate/up of a one-lane model's MLP on the tensor cores from 12-bit weights, SiLU and all, in one launch:

    h[f] = silu(rstd * (W_gate[f] @ (x * g))) * (rstd * (W_up[f] @ (x * g))),   rstd = 1 / sqrt(mean(x ** 2) + eps)

    x: [K] the fp32 residual; g: [K] bf16 the MLP's norm weight; h: [F] bf16 (rounded as a bf16 model rounds its
    activations) or fp32

The weights are kernels/packed_mma_gemv.py's layout of the two matrices interleaved by 8 rows (interleave_glu):
M-tile m holds gate rows 8m .. 8m + 7, then up rows 8m .. 8m + 7. The mma puts a tile's rows g and g + 8 in the
same lane (D's slots 0 and 2), so each lane of 0, 4, ..., 28 ends with a gate sum and its up sum side by side, and
the program writes h for its 8 rows itself: no sums in memory for a later launch, nothing to clear, and the
down-proj reads h as it reads the bf16 kernel's.

A program takes one M-tile over the whole of K (rstd needs all of x, and the SiLU the whole sums); its warps
split K (SPLIT parts, one warp each, summed across the warps at the end). B is x * g as a bf16 hi and lo part
(two mma a K-part), built one pair a lane and gathered into the slots, as packed_mma_gemv's NORMED inputs are;
the sum of x ** 2 comes from the same loads. The M-tile's exceptions are added to its sums before the SiLU.

Under Triton's interpreter (no inline asm) the decoded weights' products are summed in fp32 in the mma's place,
as packed_mma_gemv does.
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
    MMA4_SPLIT_B,
    NORMED,
    MmaPackedWeight,
    act_at,
    bf16_rounded,
    chunk_loads,
    exact_values,
    fragments,
    hi_lo_pairs,
    row_floor,
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
def normed_chunk(x_ptr, norm_ptr, chunk):
    """A chunk's B as one pair a lane ([SPLIT, 32]: pair p of each warp's chunk, columns 2p and 2p + 1 of it):
    x * g's bf16 hi and lo pairs, and the sum of x ** 2 over the pair."""
    pair = chunk[:, None] * 32 + tl.arange(0, 32)[None, :]
    first, second = split_pair(tl.load(x_ptr + pair))
    g = tl.load(norm_ptr + pair)
    hi, lo = hi_lo_pairs(first * low_half(g), second * high_half(g))
    return hi, lo, first * first + second * second


@triton.jit
def _packed_mma_glu_kernel(x_ptr, norm_ptr, lo_ptr, code_ptr, base_ptr, exc_start_ptr, exc_row_ptr, exc_col_ptr,
                           exc_value_ptr, out_ptr, eps, K: tl.constexpr, SPLIT: tl.constexpr, AHEAD: tl.constexpr,
                           EXC_BLOCK: tl.constexpr, EXC_ROUNDS: tl.constexpr, ROUND_BF16: tl.constexpr,
                           USE_MMA: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER_EARLY: tl.constexpr):  # fmt: skip
    CHUNKS: tl.constexpr = K // 64 // SPLIT  # a warp's
    m = tl.program_id(0)
    part = tl.arange(0, SPLIT)  # the warps' parts of K: [SPLIT] rows of every [SPLIT, 128] tensor below
    c = tl.arange(0, 128)  # word c: lane c // 4's K-part c % 4
    g, t, j = c // 16, c // 4 % 4, c % 4
    k0 = part * CHUNKS  # [SPLIT]: each warp's first chunk
    tile = (m * (K // 64) + k0)[:, None] * 256 + c[None, :]  # [SPLIT, 128]
    code_tile = (m * (K // 64) + k0)[:, None] * 128 + c[None, :]
    base = tl.load(base_ptr + m * 8 + g)[None, :] + (k0 * 0)[:, None]  # [SPLIT, 128]
    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    # The weights do not depend on the previous kernel: the first AHEAD chunks are in flight before its wait.
    ring = ()
    for f in tl.static_range(AHEAD):
        ring = ring + (chunk_loads(lo_ptr, code_ptr, tile, code_tile, f),)
    exc_first = tl.load(exc_start_ptr + m)
    exc_end = tl.load(exc_start_ptr + m + 1)
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()

    acc = tl.zeros([SPLIT, 128], dtype=tl.float32)  # the mma's D, or rows g's sums
    acc_8 = acc  # the interpreter's sums of rows g + 8
    sumsq = tl.zeros([SPLIT, 32], dtype=tl.float32)
    slot = c[None, :] % 16 + (k0 * 0)[:, None]  # [SPLIT, 128]: the pair (of 32) slot c takes first
    for i in tl.static_range(CHUNKS):
        words = ring[0]
        ring = ring[1:]
        if i + AHEAD < CHUNKS:
            ring = ring + (chunk_loads(lo_ptr, code_ptr, tile, code_tile, i + AHEAD),)
        a = fragments(words, base, USE_MMA)
        hi, lo, squares = normed_chunk(x_ptr, norm_ptr, k0 + i)
        sumsq += squares
        if USE_MMA:  # B's other columns take the same pairs: only column 0 of D is read
            acc = tl.inline_asm_elementwise(MMA4_SPLIT_B, "=&f,=&f,=&f,=&f," + "r," * 32 + "f,f,f,f",
                                            [a[0], a[1], a[2], a[3], tl.gather(hi, slot, 1),
                                             tl.gather(hi, slot + 16, 1), tl.gather(lo, slot, 1),
                                             tl.gather(lo, slot + 16, 1), acc],
                                            dtype=tl.float32, is_pure=True, pack=4)  # fmt: skip
        else:
            pair = (k0 + i)[:, None] * 32 + (4 * t + j)[None, :]  # [SPLIT, 128]
            every = pair >= 0
            x0, x1 = exact_values(x_ptr, norm_ptr, pair, every, 1.0, NORMED, K)
            x8, x9 = exact_values(x_ptr, norm_ptr, pair + 16, every, 1.0, NORMED, K)
            acc += low_half(a[0]) * x0 + high_half(a[0]) * x1 + low_half(a[2]) * x8 + high_half(a[2]) * x9
            acc_8 += low_half(a[1]) * x0 + high_half(a[1]) * x1 + low_half(a[3]) * x8 + high_half(a[3]) * x9

    # The warps' parts summed: [128]; then the tile's 8 gate sums and 8 up sums ([8] each, row g of each half).
    total = tl.sum(acc, axis=0)
    if USE_MMA:  # D's column 0: slot 0 (row g: gate) and slot 2 (row g + 8: up) of lanes 0, 4, ..., 28
        gate = tl.sum(tl.reshape(tl.where(c % 16 == 0, total, 0.0), [8, 16]), axis=1)
        up = tl.sum(tl.reshape(tl.where(c % 16 == 2, total, 0.0), [8, 16]), axis=1)
    else:  # row g's terms are the 16 words c of 16 g .. 16 g + 15
        gate = tl.sum(tl.reshape(total, [8, 16]), axis=1)
        up = tl.sum(tl.reshape(tl.sum(acc_8, axis=0), [8, 16]), axis=1)

    # The M-tile's exceptions: true weight * B[col] less the floor's product, which the mma summed (a power of
    # two: that product is exact), each into its row's sum.
    row8 = tl.arange(0, 8)
    for r in tl.static_range(EXC_ROUNDS):
        idx = exc_first + r * EXC_BLOCK + tl.arange(0, EXC_BLOCK)
        ok = idx < exc_end
        row = tl.load(exc_row_ptr + idx, mask=ok, other=0)
        col = tl.load(exc_col_ptr + idx, mask=ok, other=0)
        value = tl.load(exc_value_ptr + idx, mask=ok, other=0.0)
        xg = act_at(x_ptr, norm_ptr, col, ok, 1.0, NORMED, K)
        term = tl.where(ok, value * xg - row_floor(base_ptr, row, ok) * xg, 0.0)[:, None]  # [EXC_BLOCK, 1]
        in_tile = (row - m * 16)[:, None]
        gate += tl.sum(tl.where(in_tile == row8[None, :], term, 0.0), axis=0)
        up += tl.sum(tl.where(in_tile == row8[None, :] + 8, term, 0.0), axis=0)

    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(sumsq, axis=1), axis=0) / K + eps)
    gate = gate * rstd
    h = gate * tl.sigmoid(gate) * (up * rstd)
    if ROUND_BF16:  # the bits a bf16 model's activations hold, under the interpreter too
        h = bf16_rounded(h)
    tl.store(out_ptr + m * 8 + row8, h.to(out_ptr.dtype.element_ty))


def packed_mma_glu(x: torch.Tensor, norm_weight: torch.Tensor, packed: MmaPackedWeight, out: torch.Tensor, *,
                   eps: float = 1e-6, split: int | None = None, ahead: int = 4, use_pdl: bool = False,
                   trigger_early: bool = False) -> torch.Tensor:  # fmt: skip
    """out = silu(rstd * W_gate @ (x * g)) * (rstd * W_up @ (x * g)) (the module docstring), W the packed
    interleave_glu of the two [F, K] matrices.

    x: [K] fp32 contiguous; norm_weight: [K] bf16; out: [F] bf16 or fp32 contiguous. split: warps a program
    splits K over (a power of two dividing K / 64; None: 1 on a GPU, the most up to 8 under the interpreter);
    ahead: chunks a warp loads before it waits on the previous kernel, and keeps in flight."""
    n, k = packed.shape
    if x.shape != (k,) or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [{k}] fp32 (the residual), got {x.dtype} {tuple(x.shape)}")
    if norm_weight.shape != (k,) or norm_weight.dtype != torch.bfloat16 or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight: expected a contiguous [{k}] bf16, got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    if out.shape != (n // 2,) or out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{n // 2}] bf16 or fp32, got {out.dtype} {tuple(out.shape)}")
    chunks = k // CHUNK
    if split is None:
        split = 1
        while interpreted() and split < 8 and chunks % (2 * split) == 0:
            split *= 2
    if split < 1 or split & (split - 1) or chunks % split:
        raise ValueError(f"split: {split} is not a power of two dividing the {chunks} chunks of K = {k}")
    if ahead < 1:
        raise ValueError(f"ahead: expected at least 1, got {ahead}")
    _packed_mma_glu_kernel[(n // 16,)](
        x.view(torch.int64), norm_weight.view(torch.int32), packed.lo, packed.codes, packed.base, packed.exc_start,
        packed.exc_row, packed.exc_col, packed.exc_value, out, eps, K=k, SPLIT=split,
        AHEAD=min(ahead, chunks // split), EXC_BLOCK=EXC_BLOCK, EXC_ROUNDS=packed.exception_rounds(1, 1),
        ROUND_BF16=out.dtype == torch.bfloat16, USE_MMA=not interpreted(), USE_PDL=use_pdl,
        TRIGGER_EARLY=trigger_early, num_warps=split, **pdl_kwargs(use_pdl),
    )  # fmt: skip
    return out
