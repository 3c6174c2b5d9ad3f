"""The head's input from the L lane streams (Laneformer with L > 1; a single stream is normed inside lm_head).

    y = mean_l( x[l] * rstd(x[l]) * g[l] )          replicate head (each lane normed, then averaged)
    y = s * rstd(s) * g,   s = sum_l x[l]            pre_norm_lane_agg (the lane sum normed)

Every lane's rstd needs its whole row, so each program first sums squares over all of x (L * D fp32, from L2),
then writes its own block of y. Tiny (one D-vector out); it exists because the head's programs would otherwise
all repeat the first pass. Sixteen warps keep every tile of the first pass in flight at once (one memory
round trip, not one per tile).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import pdl_kwargs


@triton.jit
def _final_norm_kernel(
    x_ptr,
    norm_ptr,
    stride_norm_lane,
    out_ptr,
    eps,
    LANES: tl.constexpr,
    LANES_P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM_OF_SUM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    lanes = tl.arange(0, LANES_P)
    lane_ok = lanes < LANES
    cols = tl.arange(0, BLOCK_D)
    if NORM_OF_SUM:
        sumsq = tl.zeros([BLOCK_D], dtype=tl.float32)
    else:
        sumsq = tl.zeros([LANES_P, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(0, (D + BLOCK_D - 1) // BLOCK_D):
        c = i * BLOCK_D + cols
        x = tl.load(
            x_ptr + lanes[:, None] * D + c[None, :], mask=lane_ok[:, None] & (c < D)[None, :], other=0.0
        )
        if NORM_OF_SUM:
            s = tl.sum(x, axis=0)
            sumsq += s * s
        else:
            sumsq += x * x

    c = tl.program_id(0) * BLOCK_D + cols
    mask = lane_ok[:, None] & (c < D)[None, :]
    x = tl.load(x_ptr + lanes[:, None] * D + c[None, :], mask=mask, other=0.0)
    if NORM_OF_SUM:
        g = tl.load(norm_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        y = tl.sum(x, axis=0) / tl.sqrt(tl.sum(sumsq, axis=0) / D + eps) * g
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=1) / D + eps)  # [LANES_P]
        g = tl.load(norm_ptr + lanes[:, None] * stride_norm_lane + c[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        y = tl.sum(x * rstd[:, None] * g, axis=0) / LANES
    tl.store(out_ptr + c, y, mask=c < D)


def final_norm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    out: torch.Tensor,
    *,
    eps: float,
    norm_of_sum: bool = False,
    use_pdl: bool = False,
) -> torch.Tensor:
    """out [D] fp32 = mean of the normed lanes of x [L, D] fp32 (norm_weight [L, D] or [D]), or, with norm_of_sum,
    the norm of their sum (norm_weight [D] or [1, D])."""
    if x.dim() != 2 or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"x: expected a contiguous fp32 [L, D], got {x.dtype} {tuple(x.shape)}")
    lanes, d = x.shape
    if norm_weight.shape in ((d,), (1, d)):
        stride_norm_lane = 0
    elif norm_weight.shape == (lanes, d) and not norm_of_sum and norm_weight.is_contiguous():
        stride_norm_lane = d
    else:
        raise ValueError(f"norm_weight: expected [{d}] or [{lanes}, {d}], got {tuple(norm_weight.shape)}")
    if out.shape != (d,) or out.dtype != torch.float32:
        raise ValueError(f"out: expected fp32 [{d}], got {out.dtype} {tuple(out.shape)}")
    lanes_p = triton.next_power_of_2(lanes)
    block_d = max(16, min(512, 4096 // lanes_p, triton.next_power_of_2(d)))
    _final_norm_kernel[(triton.cdiv(d, block_d),)](
        x,
        norm_weight,
        stride_norm_lane,
        out,
        eps,
        LANES=lanes,
        LANES_P=lanes_p,
        D=d,
        BLOCK_D=block_d,
        NORM_OF_SUM=norm_of_sum,
        USE_PDL=use_pdl,
        num_warps=16,
        **pdl_kwargs(use_pdl),
    )
    return out
