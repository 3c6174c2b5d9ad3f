"""Products of a few rows as one weight stream: the speculative verify step's (the current token and k drafts,
k + 1 <= 32 rows) and other short prompt parts'. Two launchers share the kernel:

    skinny_glu:    out[l, t, n] = round(silu(round(x W1^T))) * round(x W3^T)    the MLP's gate/up and gating
    skinny_linear: out[l, t, n] = round(x W^T)                                  q|k|v, the o-proj, the down-proj
                   x: [L, T, K]; W1, W3, W: [L, N, K]; out: [L, T, N]

skinny_glu rounds as kernels/silu_mul.py rounds the two separate products' outputs, so it is the prefill's MLP
input with both matrices streamed in one pass and no [L, T, F/L] temporaries.

Why a kernel of its own: at a handful of rows a product is a weight stream, and the batched GEMM's tiles, made
for many rows, stream it more slowly; the gate/up's two products and the gating are also three launches there,
and a Triton launch can wait on the one before it with programmatic dependent launch, which cuBLAS's cannot. A
program takes BLOCK_N rows of one lane's weights and all of K, BLOCK_K columns a tile with `num_stages` tiles in
flight, and multiplies them with the T rows of x (padded to BLOCK_M >= 16, the tensor cores' smallest M) by
tl.dot into fp32 [BLOCK_M, BLOCK_N] accumulators. x is L2-resident (T * K * 2 bytes a lane) and read by every
program of its lane; the weights are read once, evicted first. Where those programs are too few to fill the GPU
and the weight is large (a one-lane model's down-proj: a long K over few rows of W), cuBLAS splits K and wins:
`few_rows_matmul` picks.

Grid: (cdiv(N, BLOCK_N), L).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs, sm_count

MAX_ROWS = 32  # rows a launch takes (BLOCK_M up to 32: past that a prompt's products are cuBLAS's)
BLOCK_N = 32  # rows of the weight a program takes
# a weight this small is latency-bound: one launch wins however few its programs
SMALL_BYTES = 4 * 1024**2


@triton.jit
def _skinny_kernel(
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
    GLU: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
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
        # [BLOCK_M, BLOCK_N]; "ieee": fp32 weights multiply exactly, not in TF32 (bf16 ones are exact either way)
        gate = tl.dot(xt, tl.trans(w1), gate, input_precision="ieee")
        if GLU:
            w3 = tl.load(w3_ptr + w_offs + k0, mask=w_mask, other=0.0, eviction_policy="evict_first")
            up = tl.dot(xt, tl.trans(w3), up, input_precision="ieee")
    dtype = out_ptr.dtype.element_ty
    if GLU:
        g = gate.to(dtype).to(tl.float32)  # each product rounded to the dtype, as a matmul's output is
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # rounded as F.silu's output is
        y = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    else:
        y = gate.to(dtype)
    out_offs = (lane * T + ts).to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out_ptr + out_offs, y, mask=t_ok[:, None] & row_ok[None, :])


def skinny_glu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, out: torch.Tensor | None = None,
               use_pdl: bool = False, **blocks) -> torch.Tensor:  # fmt: skip
    """silu(x w1^T) * (x w3^T) for x [L, T, K] (T <= MAX_ROWS; a lane-broadcast view, stride 0 over L, is fine) and
    w1, w3 [L, N, K]: out [L, T, N] in x's dtype (a contiguous one to write into, or allocated). The blocks are
    one setting for every model: on the gate/up of laneformer-2b, llama-3.2-1b and qwen3-1.7b at 9 rows, each
    model's own best blocks were barely faster."""
    return _launch(x, w1, w3, out, use_pdl, **blocks)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  use_pdl: bool = False, **blocks) -> torch.Tensor:  # fmt: skip
    """x w^T for x [L, T, K] (T <= MAX_ROWS) and w [L, N, K]: out [L, T, N] in x's dtype, rounded once as a
    matmul's output is."""
    return _launch(x, w, None, out, use_pdl, name="w", **blocks)


def few_rows_matmul(x: torch.Tensor, w: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
    """x [L, T, K] @ w [L, N, K]^T: [L, T, N], by skinny_linear where it streams w faster than cuBLAS (T <= MAX_ROWS
    on a GPU, its programs filling the multiprocessors or w small), else by torch's matmul. On the CPU the
    interpreter's kernel is only slower."""
    if x.shape[1] <= MAX_ROWS and w.device.type == "cuda" and not interpreted():
        fills = w.shape[0] * triton.cdiv(w.shape[1], BLOCK_N) >= sm_count(w.device)
        if fills or w.numel() * w.element_size() <= SMALL_BYTES:
            return skinny_linear(x, w, use_pdl=use_pdl)
    return x @ w.mT


def _launch(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, out: torch.Tensor | None,
            use_pdl: bool, name: str = "w1", block_n: int = BLOCK_N, block_k: int = 128, num_warps: int = 4,
            num_stages: int = 5) -> torch.Tensor:  # fmt: skip
    lanes, rows, k = x.shape
    if w1.dim() != 3 or w1.shape[0] != lanes or w1.shape[2] != k:
        raise ValueError(f"{name}: expected [{lanes}, N, {k}], got {tuple(w1.shape)}")
    if w3 is not None and w3.shape != w1.shape:
        raise ValueError(f"w3: expected {tuple(w1.shape)}, got {tuple(w3.shape)}")
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"x: 1 to {MAX_ROWS} rows, got {rows}")
    if x.stride(2) != 1 or not w1.is_contiguous() or not (w3 is None or w3.is_contiguous()):
        raise ValueError("x: contiguous rows, and contiguous weights, expected")
    n = w1.shape[1]
    if out is None:
        out = torch.empty(lanes, rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (lanes, rows, n) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{lanes}, {rows}, {n}], got {tuple(out.shape)}")
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    launch = {"num_warps": num_warps, "num_stages": num_stages, **pdl_kwargs(use_pdl)}
    _skinny_kernel[(triton.cdiv(n, block_n), lanes)](
        x, x.stride(0), x.stride(1), w1, w1 if w3 is None else w3, out, rows, n, K=k,
        BLOCK_M=16 if rows <= 16 else 32, BLOCK_N=block_n, BLOCK_K=block_k, GLU=w3 is not None,
        USE_PDL=use_pdl, **({} if interpreted() else launch),
    )  # fmt: skip
    return out
