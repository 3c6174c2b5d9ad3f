"""The whole MLP block of one lane in one launch: ffn norm, gate/up, SiLU, down-proj and the residual add.

    h[n]   = bf16( silu(W1[n] . (g * x) * rstd) * (W3[n] . (g * x) * rstd) ),   rstd = 1 / sqrt(mean(x^2) + eps)
    out[k] = x[k] + sum_n W2[k, n] h[n]                                          (out zeroed beforehand)

Two launches (rmsnorm_gemv's gate/up, then lane_reduce_gemv's down-proj) meet at a boundary where the down-proj
waits for every row of h. Here a program owns a run of intermediate rows n: it computes their h and multiplies
them at once into the matching columns of W2, which the runner stores transposed (W2t [N, K]: row n is W2's
column n, so that a program streams contiguous rows of all three matrices). Every weight load is independent of
x, so a program's stream never waits on another program; the cost is moved to the end, where each program adds
its [K] partial into `out` with atomics. Program 0 also adds the residual x, so `out` ends as the block's output.

Rounding: h is rounded to the weights' dtype before the down-proj, as the two-launch path stores it. The fp32
sum over n is taken in the order the atomics land, which varies from run to run (the last bits of `out`).

Bytes: the three matrices once (3 * N * K elements), x once per program (L2 hits), N / (ROW_BLOCKS * BLOCK_N)
atomic partials of K fp32 values.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs, same_memory
from kernels.rmsnorm_gemv import next_row_block, row_dots, weight_tiles


@triton.jit
def _accumulate(acc, h, tiles):
    """acc[i] + h[:, None] * tiles[i] for every K tile i: this row block's share of the down-proj, kept per row
    ([BLOCK_N, BLOCK_K] each) so that no reduction across threads sits in the loop."""
    new = ()
    for i in tl.static_range(len(acc)):
        new = new + (acc[i] + h[:, None] * tiles[i].to(tl.float32),)
    return new


@triton.jit
def _fused_mlp_kernel(
    x_ptr,
    norm_ptr,
    w1_ptr,
    w3_ptr,
    w2t_ptr,
    out_ptr,
    N,
    eps,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    TRIGGER_EARLY: tl.constexpr,
):
    TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    pid = tl.program_id(0)
    rows = pid * ROW_BLOCKS * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_offs = rows.to(tl.int64)[:, None] * K + cols[None, :]  # [BLOCK_N, BLOCK_K], the same in all three

    # Weights depend on nothing: the first block's W2t rows and PREFETCH tiles of W1 / W3 are in flight before
    # the wait for the kernel that wrote x.
    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    dn = weight_tiles(w2t_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, TILES)
    gate = weight_tiles(w1_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, PREFETCH)
    up = weight_tiles(w3_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, PREFETCH)
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()
    gate = gate + weight_tiles(w1_ptr, w_offs, row_ok, cols, K, BLOCK_K, PREFETCH, TILES - PREFETCH)
    up = up + weight_tiles(w3_ptr, w_offs, row_ok, cols, K, BLOCK_K, PREFETCH, TILES - PREFETCH)

    # x and g * x by K tiles; program 0's accumulator starts from the residual (row 0 of each tile).
    first = (tl.arange(0, BLOCK_N) == 0)[:, None] & (pid == 0)
    xs = ()
    acc = ()
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(TILES):
        k_ok = i * BLOCK_K + cols < K
        xk = tl.load(x_ptr + i * BLOCK_K + cols, mask=k_ok, other=0.0).to(tl.float32)
        sumsq += xk * xk
        acc = acc + (tl.where(first, xk[None, :], 0.0),)
        xs = xs + (xk * tl.load(norm_ptr + i * BLOCK_K + cols, mask=k_ok, other=0.0).to(tl.float32),)
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps)

    # ROW_BLOCKS blocks of BLOCK_N rows in turn, the next block's three tiles in flight while this one is used.
    for j in tl.static_range(ROW_BLOCKS):
        if j + 1 < ROW_BLOCKS:
            next_rows, next_ok, next_offs = next_row_block(rows, w_offs, N, BLOCK_N, K)
            next_gate = weight_tiles(w1_ptr, next_offs, next_ok, cols, K, BLOCK_K, 0, TILES)
            next_up = weight_tiles(w3_ptr, next_offs, next_ok, cols, K, BLOCK_K, 0, TILES)
            next_dn = weight_tiles(w2t_ptr, next_offs, next_ok, cols, K, BLOCK_K, 0, TILES)
        y = row_dots(gate, xs, BLOCK_N, BLOCK_K) * rstd  # [BLOCK_N]
        h = y * tl.sigmoid(y) * (row_dots(up, xs, BLOCK_N, BLOCK_K) * rstd)
        h = tl.where(row_ok, h, 0.0).to(w1_ptr.dtype.element_ty).to(tl.float32)
        acc = _accumulate(acc, h, dn)
        if j + 1 < ROW_BLOCKS:
            rows, row_ok, w_offs, gate, up, dn = next_rows, next_ok, next_offs, next_gate, next_up, next_dn

    for i in tl.static_range(TILES):
        k_ok = i * BLOCK_K + cols < K
        tl.atomic_add(out_ptr + i * BLOCK_K + cols, tl.sum(acc[i], axis=0), mask=k_ok, sem="relaxed")


def _pick_blocks(n: int, k: int) -> tuple[int, int, int, int]:
    """block_n, block_k, row_blocks, num_warps."""
    if interpreted():  # programs run one after another there: few, large ones
        return min(16, triton.next_power_of_2(n)), min(128, triton.next_power_of_2(k)), 2, 4
    return 2, min(512, triton.next_power_of_2(k)), 8, 4


def fused_mlp(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2t: torch.Tensor,
    out: torch.Tensor,
    *,
    eps: float = 1e-6,
    use_pdl: bool = False,
    trigger_early: bool = False,
    prefetch: int = 1,
    block_n: int | None = None,
    block_k: int | None = None,
    row_blocks: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """out += x + W2 @ (silu(W1 @ hn) * (W3 @ hn)), hn = rmsnorm(x) * norm_weight, for one lane.

    x: [1, K] fp32 (the residual); norm_weight: [K] or [1, K]; w1, w3: [1, N, K]; w2t: [1, N, K] (the
    down-proj's [K, N] transposed); out: [1, K] fp32, zero on entry (the atomics add into it), x + MLP(x) on
    exit; it must not be x. prefetch: W1 / W3 tiles ([block_n, block_k]) loaded before the wait for x.
    """
    if w1.dim() != 3 or w1.shape[0] != 1:
        raise ValueError(f"w1: expected one lane [1, N, K], got {tuple(w1.shape)}")
    _, n, k = w1.shape
    for name, w in (("w1", w1), ("w3", w3), ("w2t", w2t)):
        if w.shape != (1, n, k) or not w.is_contiguous():
            raise ValueError(f"{name}: expected contiguous (1, {n}, {k}), got {tuple(w.shape)}")
    if w3.dtype != w1.dtype or w2t.dtype != w1.dtype:
        raise ValueError(f"w3, w2t: expected {w1.dtype} like w1, got {w3.dtype} and {w2t.dtype}")
    for name, t in (("x", x), ("out", out)):
        if t.shape != (1, k) or not t.is_contiguous() or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected a contiguous fp32 (1, {k}), got {t.dtype} {tuple(t.shape)}")
    if same_memory(out, x):
        raise ValueError("out: must not be x (programs still read x while others add into out)")
    if norm_weight.numel() != k:
        raise ValueError(f"norm_weight: expected [{k}] or [1, {k}], got {tuple(norm_weight.shape)}")
    for name, t in (("x", x), ("norm_weight", norm_weight), ("w3", w3), ("w2t", w2t), ("out", out)):
        if t.device != w1.device:
            raise ValueError(f"{name}: on {t.device}, expected {w1.device}")
    if prefetch < 1:
        raise ValueError(f"prefetch: expected at least 1 tile, got {prefetch}")
    auto_n, auto_k, auto_blocks, auto_warps = _pick_blocks(n, k)
    block_n, block_k = block_n or auto_n, block_k or auto_k
    row_blocks, num_warps = row_blocks or auto_blocks, num_warps or auto_warps
    grid = (triton.cdiv(n, block_n * row_blocks),)
    _fused_mlp_kernel[grid](
        x,
        norm_weight,
        w1,
        w3,
        w2t,
        out,
        n,
        eps,
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROW_BLOCKS=row_blocks,
        PREFETCH=min(prefetch, triton.cdiv(k, block_k)),
        USE_PDL=use_pdl,
        TRIGGER_EARLY=trigger_early,
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    return out
