"""Prefill's block boundary in one pass: the lane reduction of a block's partials into the residual streams,
then the next block's RMSNorm.

    x_out[l, t] = x[l, t] + reduce(partial, past)[l, t]
    h[l, t]     = norm_weight[l] * rmsnorm(x_out[l, t])        (fp32 statistics, rounded as the reference does)

with reduce as model.Transformer._reduce (the runner's `reduction` modes):
    sum      sum over lanes of partial[:, t]                (one lane: the partial itself)
    scaled   partial[l, t] * sqrt(L)
    delayed  partial[l, t] + sum over lanes of past[:, t] - past[l, t]   (past: the raw partials d layers back)

In eager PyTorch this boundary is ~8 launches over [L, T, D] tensors (casts, the lane sum, adds, the norm's
fp32 copy), which at 4,096 tokens of a Laneformer costs more GPU time than all the matrix products. Here each
program owns one position t for all lanes (the lane sum needs them together) and makes two passes over D:
the sums and the new residual, then the norm from the (L2-resident) row it just wrote.

Bytes: x, partial (and past) read once, x_out and h written once; the second pass re-reads x_out from L2.
"""

import math

import torch
import triton
import triton.language as tl

from kernels import interpreted

MODES = {"sum": 0, "scaled": 1, "delayed": 2}


@triton.jit
def _prefill_residual_norm_kernel(
    x_ptr,
    stride_x_lane,
    stride_x_t,
    partial_ptr,
    past_ptr,
    norm_ptr,
    x_out_ptr,
    h_ptr,
    lanes,
    scale,
    eps,
    D: tl.constexpr,
    LP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MODE: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, LP)
    lane_ok = lane < lanes
    cols = tl.arange(0, BLOCK_D)
    T = tl.num_programs(0)
    sumsq = tl.zeros([LP], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        mask = lane_ok[:, None] & (d < D)[None, :]
        dense = (lane[:, None] * T + t) * D + d[None, :]  # [LP, BLOCK_D] in a contiguous [L, T, D]
        x = tl.load(x_ptr + lane[:, None] * stride_x_lane + t * stride_x_t + d[None, :], mask=mask, other=0.0)
        partial = tl.load(partial_ptr + dense, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            add = tl.sum(partial, axis=0)[None, :] + tl.zeros_like(partial)
        elif MODE == 1:
            add = partial * scale
        else:
            past = tl.load(past_ptr + dense, mask=mask, other=0.0).to(tl.float32)
            add = partial + tl.sum(past, axis=0)[None, :] - past
        new = (x.to(tl.float32) + add).to(x_out_ptr.dtype.element_ty)
        tl.store(x_out_ptr + dense, new, mask=mask)
        new_f = new.to(tl.float32)
        sumsq += tl.sum(new_f * new_f, axis=1)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(sumsq / D + eps)
        tl.debug_barrier()  # the row this program just wrote is read back below
        for d0 in range(0, D, BLOCK_D):
            d = d0 + cols
            mask = lane_ok[:, None] & (d < D)[None, :]
            dense = (lane[:, None] * T + t) * D + d[None, :]
            new_f = tl.load(x_out_ptr + dense, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(norm_ptr + lane[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
            normed = (new_f * rstd[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)  # as model.rms_norm
            tl.store(h_ptr + dense, (w * normed).to(h_ptr.dtype.element_ty), mask=mask)


def prefill_residual_norm(
    x: torch.Tensor,
    partial: torch.Tensor,
    *,
    mode: str,
    past: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + reduce(partial, past), rmsnorm of that * norm_weight or None without norm_weight).

    x: [L, T, D] (lanes may be a broadcast view: stride 0), last dim contiguous; partial, past: contiguous
    [L, T, D] like x's dtype; norm_weight: [L, D]; mode: "sum" | "scaled" | "delayed" (needs past).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x: expected [L, T, D] with a contiguous last dim, got {tuple(x.shape)}")
    lanes, T, D = x.shape
    if partial.shape != x.shape or not partial.is_contiguous():
        raise ValueError(f"partial: expected a contiguous {tuple(x.shape)}, got {tuple(partial.shape)}")
    if (mode == "delayed") != (past is not None) or (
        past is not None and (past.shape != x.shape or not past.is_contiguous())
    ):
        raise ValueError(f"past: a contiguous {tuple(x.shape)} with mode 'delayed' only")
    if norm_weight is not None and (norm_weight.shape != (lanes, D) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight: expected a contiguous [{lanes}, {D}]")
    x_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x_out) if norm_weight is not None else None
    block_d = min(triton.next_power_of_2(D), 128 if interpreted() else 512)
    lp = triton.next_power_of_2(lanes)
    _prefill_residual_norm_kernel[(T,)](
        x,
        x.stride(0),
        x.stride(1),
        partial,
        past if past is not None else partial,
        norm_weight if norm_weight is not None else partial,
        x_out,
        h if h is not None else x_out,
        lanes,
        math.sqrt(lanes),
        eps,
        D=D,
        LP=lp,
        BLOCK_D=block_d,
        MODE=MODES[mode],
        HAS_NORM=norm_weight is not None,
        num_warps=8 if lp * block_d >= 4096 else 4,
    )
    return x_out, h
