"""RMSNorm fused into a lane-grouped matrix-vector product (the QKV and the gate/up projections of decode).

    out[l, n] = epilogue( sum_k W[l, n, k] * x[l, k] * g[k] * rstd[l] ),   rstd[l] = 1 / sqrt(mean_k x[l, k]^2 + eps)

The norm is linear in x up to the scalar rstd, so the kernel never materialises the normed vector: every
program reads x * g and the sum of x^2 once (registers), then streams its rows against it and scales by rstd at
the end. Each program covers full rows (all of K), so no second pass and no split-K reduction is needed. A
block's weight tiles are all requested before any product is summed (so all of them are in flight together,
rather than x and weights interleaved tile by tile), and with row_blocks > 1 a program takes
several blocks in turn with the next block's tiles in flight while it sums the current one.

Epilogues: `+ bias` (Qwen2's q/k/v), or `silu(W x) * (W_up x)` (gate/up of the MLP, both matrices streamed in
one pass).

Bytes: the weight once (L * N * K elements), x and g once per program (L1/L2 hits), out once. Grid: row
blocks x lanes, sized so that every multiprocessor holds several programs (latency hiding without split-K).
With layer 0, x is a row of the embedding table chosen by a token id that lives on the device.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs, sm_count


@triton.jit
def weight_tiles(w_ptr, offs, row_ok, cols, K: tl.constexpr, BLOCK_K: tl.constexpr, FIRST: tl.constexpr,
                  COUNT: tl.constexpr):  # fmt: skip
    """Loads of the weight tiles FIRST .. FIRST + COUNT - 1 ([BLOCK_N, BLOCK_K] each) of the rows at offs, as a
    tuple. Weights are read once per token: evicted first, so activations and the KV cache stay in L2."""
    tiles = ()
    for i in tl.static_range(FIRST, FIRST + COUNT):
        mask = row_ok[:, None] & (i * BLOCK_K + cols < K)[None, :]
        tiles = tiles + (
            tl.load(w_ptr + offs + i * BLOCK_K, mask=mask, other=0.0, eviction_policy="evict_first"),
        )
    return tiles


@triton.jit
def normed_x_tiles(
    x_row, norm_row, cols, eps, K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_NORM: tl.constexpr
):
    """x * g by K tiles (a tuple of [BLOCK_K] fp32) and the norm's rstd (1 without a norm): RMSNorm's scalar is
    applied to the products at the end, so the normed vector is never materialised."""
    xs = ()
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):
        k_ok = i * BLOCK_K + cols < K  # K is a constexpr: a multiple of 8 keeps the loads 16 bytes wide
        xk = tl.load(x_row + i * BLOCK_K + cols, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            sumsq += xk * xk
            xk = xk * tl.load(norm_row + i * BLOCK_K + cols, mask=k_ok, other=0.0).to(tl.float32)
        xs = xs + (xk,)
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps) if HAS_NORM else tl.full([], 1.0, tl.float32)
    return xs, rstd


@triton.jit
def next_row_block(rows, w_offs, N, BLOCK_N: tl.constexpr, K: tl.constexpr):
    """The rows, their mask and their weight offsets one block of BLOCK_N rows further on."""
    next_rows = rows + BLOCK_N
    return next_rows, next_rows < N, w_offs + BLOCK_N * K


@triton.jit
def row_dots(tiles, xs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] fp32: each row of the weight tiles (a tuple of [BLOCK_N, BLOCK_K]) against the x tiles; one
    [BLOCK_N, BLOCK_K] accumulator, reduced across K once at the end."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(len(tiles)):
        acc += tiles[i].to(tl.float32) * xs[i][None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _rmsnorm_gemv_kernel(
    x_ptr,
    stride_x_lane,
    token_ptr,
    norm_ptr,
    stride_norm_lane,
    w_ptr,
    w_up_ptr,
    bias_ptr,
    out_ptr,
    N,
    eps,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_FROM_TOKEN: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    USE_PDL: tl.constexpr,
    TRIGGER_EARLY: tl.constexpr,
):
    TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    lane = tl.program_id(1)
    rows = tl.program_id(0) * ROW_BLOCKS * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_offs = (lane * N + rows).to(tl.int64)[:, None] * K + cols[None, :]  # [BLOCK_N, BLOCK_K]

    # The first PREFETCH weight tiles are in flight before we wait for the kernel that produces x (more of them
    # keeps more bytes moving across the boundary, at the cost of registers); the rest of the block after it.
    if USE_PDL and TRIGGER_EARLY:  # the next kernel may launch now, beside this one (its loads too)
        gdc_launch_dependents()
    w = weight_tiles(w_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, PREFETCH)
    u = weight_tiles(w_up_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, PREFETCH if GATED else 0)
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()
    w = w + weight_tiles(w_ptr, w_offs, row_ok, cols, K, BLOCK_K, PREFETCH, TILES - PREFETCH)
    u = u + weight_tiles(
        w_up_ptr, w_offs, row_ok, cols, K, BLOCK_K, PREFETCH, TILES - PREFETCH if GATED else 0
    )

    # x * g by K tiles ([BLOCK_K] fp32 each), and the norm's statistics. With X_FROM_TOKEN every lane starts
    # from the same embedding row.
    x_row = x_ptr + tl.load(token_ptr).to(tl.int64) * K if X_FROM_TOKEN else x_ptr + lane * stride_x_lane
    norm_row = norm_ptr + lane * stride_norm_lane
    xs, rstd = normed_x_tiles(x_row, norm_row, cols, eps, K, BLOCK_K, HAS_NORM)

    # ROW_BLOCKS blocks of BLOCK_N rows one after another, the next block's tiles in flight while this one's
    # products are summed: a program streams without a gap from one block to the next (no program to end and
    # start between them), and the grid is smaller by ROW_BLOCKS.
    for j in tl.static_range(ROW_BLOCKS):
        if j + 1 < ROW_BLOCKS:
            next_rows, next_ok, next_offs = next_row_block(rows, w_offs, N, BLOCK_N, K)
            next_w = weight_tiles(w_ptr, next_offs, next_ok, cols, K, BLOCK_K, 0, TILES)
            next_u = weight_tiles(w_up_ptr, next_offs, next_ok, cols, K, BLOCK_K, 0, TILES if GATED else 0)
        y = row_dots(w, xs, BLOCK_N, BLOCK_K) * rstd  # [BLOCK_N]
        if HAS_BIAS:
            y += tl.load(bias_ptr + lane * N + rows, mask=row_ok, other=0.0).to(tl.float32)
        if GATED:
            y = y * tl.sigmoid(y) * (row_dots(u, xs, BLOCK_N, BLOCK_K) * rstd)
        tl.store(out_ptr + lane * N + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)
        if j + 1 < ROW_BLOCKS:
            rows, row_ok, w_offs, w, u = next_rows, next_ok, next_offs, next_w, next_u


def _pick_blocks(lanes: int, n: int, k: int, gated: bool, device: torch.device) -> tuple[int, int, int]:
    if interpreted():  # programs run one after another there: few, large ones
        return min(64, triton.next_power_of_2(n)), min(128, triton.next_power_of_2(k)), 4
    # Four warps, and 8 rows a program (4 for the gate/up pair when K <= 2048): the sweep's best
    # (docs/fast-path.md). The K loop is unrolled, so a program's loads are issued together.
    block_k, block_n, num_warps = min(512, triton.next_power_of_2(k)), (4 if gated and k <= 2048 else 8), 4
    if lanes == 1 and not gated:
        # The q|k|v rows of one lane: 8 rows of 1024 on 8 warps, wider than the rest; with 8 lanes
        # (laneformer-2b) the narrower tiles stay faster.
        block_k, num_warps = min(1024, triton.next_power_of_2(k)), 8
    while block_n > 1 and lanes * triton.cdiv(n, block_n) < 2 * sm_count(device):
        block_n //= 2
    return block_n, block_k, num_warps


def _pick_row_blocks(n: int, k: int, gated: bool, device: torch.device) -> int:
    """The gate/up pair at K <= 2048 runs as blocks of 2 rows (the automatic 4 halved), as many a program as
    leave about 8 programs a multiprocessor: 4 for llama-3.2-1b's 8,192 rows, 3 for qwen3-1.7b's 6,144, each
    the best of the counts tried. At K = 3072 (laneformer-2b) one block is best (more blocks cost registers), as for
    the q|k|v rows (docs/fast-path.md). Under the interpreter: one."""
    if not gated or k > 2048 or interpreted():
        return 1
    return max(2, round(n / (2 * 8 * sm_count(device))))


def rmsnorm_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_up: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    token: torch.Tensor | None = None,
    use_pdl: bool = False,
    trigger_early: bool = False,
    prefetch: int = 1,
    row_blocks: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """out[l] = W[l] @ (rmsnorm(x[l]) * norm_weight) (+ bias[l]), or silu(W[l] @ h) * (W_up[l] @ h) with weight_up.

    prefetch: weight tiles ([block_n, block_k] of each matrix) a program loads before it waits for x (at least
    1; more than the row's tiles means all of them). row_blocks: blocks of block_n rows each program takes in
    turn, the next block's weights loaded while the current one is summed (None: _pick_row_blocks).

    x: [L, K] residual (any float dtype), or, with `token` (an int tensor [1] on the device), the embedding table
    [V, K] whose row token[0] every lane reads. weight, weight_up: [L, N, K]; bias, out: [L, N];
    norm_weight: [K] (shared by the lanes) or [L, K]; None skips the norm.
    """
    if weight.dim() != 3 or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [L, N, K] tensor, got {tuple(weight.shape)}")
    lanes, n, k = weight.shape
    if weight_up is not None and (weight_up.shape != weight.shape or not weight_up.is_contiguous()):
        raise ValueError(
            f"weight_up: expected contiguous {tuple(weight.shape)}, got {tuple(weight_up.shape)}"
        )
    if weight_up is not None and bias is not None:
        raise ValueError("bias: not supported together with weight_up")
    if out.shape != (lanes, n) or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous ({lanes}, {n}), got {tuple(out.shape)}")
    if token is None:
        if x.dim() != 2 or x.shape[1] != k or x.shape[0] not in (1, lanes) or x.stride(1) != 1:
            raise ValueError(f"x: expected [{lanes} or 1, {k}] with unit inner stride, got {tuple(x.shape)}")
        stride_x_lane = x.stride(0) if x.shape[0] == lanes else 0
    else:
        if x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
            raise ValueError(f"x: expected the embedding table [V, {k}], got {tuple(x.shape)}")
        if token.numel() != 1 or token.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"token: expected one int32/int64 element, got {token.dtype} {tuple(token.shape)}"
            )
        stride_x_lane = 0
    stride_norm_lane = 0
    if norm_weight is not None:
        if norm_weight.shape == (k,):
            stride_norm_lane = 0
        elif norm_weight.shape == (lanes, k) and norm_weight.is_contiguous():
            stride_norm_lane = k
        else:
            raise ValueError(f"norm_weight: expected [{k}] or [{lanes}, {k}], got {tuple(norm_weight.shape)}")
    if bias is not None and (bias.shape != (lanes, n) or not bias.is_contiguous()):
        raise ValueError(f"bias: expected contiguous ({lanes}, {n}), got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        if t.device != weight.device:
            raise ValueError(f"{name}: on {t.device}, expected {weight.device}")

    auto_n, auto_k, auto_warps = _pick_blocks(lanes, n, k, weight_up is not None, weight.device)
    if row_blocks is None:
        row_blocks = _pick_row_blocks(n, k, weight_up is not None, weight.device)
    if (
        row_blocks > 1
    ):  # two blocks are in flight at a time: half the rows each keeps the registers as they were
        auto_n = max(1, auto_n // 2)
    block_n, block_k, num_warps = block_n or auto_n, block_k or auto_k, num_warps or auto_warps
    if prefetch < 1:
        raise ValueError(f"prefetch: expected at least 1 tile, got {prefetch}")
    if row_blocks < 1:
        raise ValueError(f"row_blocks: expected at least 1, got {row_blocks}")
    grid = (triton.cdiv(triton.cdiv(n, block_n), row_blocks), lanes)
    _rmsnorm_gemv_kernel[grid](
        x,
        stride_x_lane,
        token if token is not None else x,
        norm_weight if norm_weight is not None else x,
        stride_norm_lane,
        weight,
        weight_up if weight_up is not None else weight,
        bias if bias is not None else weight,
        out,
        n,
        eps,
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_NORM=norm_weight is not None,
        GATED=weight_up is not None,
        HAS_BIAS=bias is not None,
        X_FROM_TOKEN=token is not None,
        PREFETCH=min(prefetch, triton.cdiv(k, block_k)),
        ROW_BLOCKS=row_blocks,
        USE_PDL=use_pdl,
        TRIGGER_EARLY=trigger_early,
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    return out
