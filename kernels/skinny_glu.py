"""The MLP's gate and up products of a few rows and their gating in one launch: the speculative verify step's
(the current token and k drafts, k + 1 <= 32 rows) and other short prompt parts'.

    out[l, t, n] = round(silu(round(x W1^T))) * round(x W3^T)        x: [L, T, K]; W1, W3: [L, N, K]; out: [L, T, N]

rounded as kernels/silu_mul.py rounds the two separate products' outputs, so it is the prefill's MLP input with
both matrices streamed in one pass and no [L, T, F/L] temporaries.

Why a kernel of its own: at a handful of rows the gate/up is a weight stream, and the batched GEMM's tiles, made
for many rows, stream it more slowly; the two products and the gating are also three launches there. A program
takes BLOCK_N rows of one lane's W1 and W3 and all of K, BLOCK_K columns a tile with `num_stages` tiles in flight,
and multiplies them with the T rows of x (padded to BLOCK_M >= 16, the tensor cores' smallest M) by tl.dot into
two fp32 [BLOCK_M, BLOCK_N] accumulators. x is L2-resident (T * K * 2 bytes a lane) and read by every program of
its lane; the weights are read once, evicted first. (The other products of a short prompt part, without a
gating to fuse, measured no faster this way than cuBLAS's: they stay there.)

Grid: (cdiv(N, BLOCK_N), L).
"""

import torch
import triton
import triton.language as tl

from kernels import interpreted

MAX_ROWS = 32  # rows a launch takes (BLOCK_M up to 32: past that a prompt's products are cuBLAS's)


@triton.jit
def _skinny_glu_kernel(
    x_ptr,
    stride_x_lane,
    stride_x_row,
    w1_ptr,
    w3_ptr,
    out_ptr,
    T,
    N,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    lane = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of W1 and W3
    row_ok = rows < N
    ts = tl.arange(0, BLOCK_M)  # [BLOCK_M] of x
    t_ok = ts < T
    cols = tl.arange(0, BLOCK_K)
    w_offs = (lane * N + rows).to(tl.int64)[:, None] * K + cols[None, :]  # [BLOCK_N, BLOCK_K]
    x_offs = lane * stride_x_lane + ts[:, None] * stride_x_row + cols[None, :]  # [BLOCK_M, BLOCK_K]
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + cols < K
        xt = tl.load(x_ptr + x_offs + k0, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = row_ok[:, None] & k_ok[None, :]
        w1 = tl.load(w1_ptr + w_offs + k0, mask=w_mask, other=0.0, eviction_policy="evict_first")
        w3 = tl.load(w3_ptr + w_offs + k0, mask=w_mask, other=0.0, eviction_policy="evict_first")
        gate = tl.dot(xt, tl.trans(w1), gate)  # [BLOCK_M, BLOCK_N]
        up = tl.dot(xt, tl.trans(w3), up)
    dtype = out_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)  # each product rounded to the dtype, as a matmul's output is
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # rounded as F.silu's output is
    y = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    out_offs = (lane * T + ts).to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out_ptr + out_offs, y, mask=t_ok[:, None] & row_ok[None, :])


def skinny_glu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, out: torch.Tensor | None = None,
               block_n: int = 32, block_k: int = 128, num_warps: int = 4, num_stages: int = 5) -> torch.Tensor:  # fmt: skip
    """silu(x w1^T) * (x w3^T) for x [L, T, K] (T <= MAX_ROWS; a lane-broadcast view, stride 0 over L, is fine) and
    w1, w3 [L, N, K]: out [L, T, N] in x's dtype (a contiguous one to write into, or allocated). The blocks are
    one setting for every model: on the gate/up of laneformer-2b, llama-3.2-1b and qwen3-1.7b at 9 rows, each
    model's own best blocks were barely faster."""
    lanes, rows, k = x.shape
    if w1.dim() != 3 or w1.shape[0] != lanes or w1.shape[2] != k:
        raise ValueError(f"w1: expected [{lanes}, N, {k}], got {tuple(w1.shape)}")
    if w3.shape != w1.shape:
        raise ValueError(f"w3: expected {tuple(w1.shape)}, got {tuple(w3.shape)}")
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"x: 1 to {MAX_ROWS} rows, got {rows}")
    if x.stride(2) != 1 or not w1.is_contiguous() or not w3.is_contiguous():
        raise ValueError("x: contiguous rows, and contiguous weights, expected")
    n = w1.shape[1]
    if out is None:
        out = torch.empty(lanes, rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (lanes, rows, n) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{lanes}, {rows}, {n}], got {tuple(out.shape)}")
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    launch = {} if interpreted() else {"num_warps": num_warps, "num_stages": num_stages}
    _skinny_glu_kernel[(triton.cdiv(n, block_n), lanes)](
        x, x.stride(0), x.stride(1), w1, w3, out, rows, n, K=k,
        BLOCK_M=16 if rows <= 16 else 32, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )  # fmt: skip
    return out
