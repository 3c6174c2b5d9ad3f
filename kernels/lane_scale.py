"""Every lane's norm scale over one normed sequence: the first layer's attention norm in the prefill.

    out[l, t, d] = round(scale[l, d] * normed[t, d])        (fp32 product, rounded once to out's dtype)

The lanes all start from the same embedding rows, so the prefill normalises them once ([T, D]) and only the
per-lane scale spreads them to [L, T, D]. Eager, that is the broadcast `scale[:, None] * normed[None]`, and the
broadcast keeps PyTorch off its vectorized elementwise path: 0.27 ms at laneformer-2b's [8, 4,094, 3,072] bf16
on an H200 (~0.8 TB/s; the prefill's profile), where the 200 MB it writes need ~50 us. The product is the
eager one (both factors widened to fp32, multiplied, rounded to the dtype), so the bits are the same.

Grid: one program a position t. It loads normed[t] once and writes the row of every lane, each one 16-byte
vectors (D is a constexpr multiple of 8 in the models here, so the column mask is constant over each vector).
"""

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _lane_scale_kernel(normed_ptr, scale_ptr, out_ptr, T, LANES: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    n = tl.load(normed_ptr + t * D + d, mask=mask, other=0.0).to(tl.float32)
    for lane in tl.static_range(LANES):
        s = tl.load(scale_ptr + lane * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (lane * T + t) * D + d, (s * n).to(out_ptr.dtype.element_ty), mask=mask)


def lane_scale(normed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [L, T, D] = scale[l] * normed, rounded as eager `scale[:, None] * normed` rounds it.

    normed: contiguous [T, D]; scale: contiguous [L, D] of the same dtype (fp32, fp16 or bf16) and device; out:
    contiguous [L, T, D] like them (allocated when None). Returns out."""
    if normed.dim() != 2 or not normed.is_contiguous() or normed.dtype not in DTYPES:
        raise ValueError(f"normed: expected a contiguous fp32/fp16/bf16 [T, D], got {normed.dtype} "
                         f"{tuple(normed.shape)}")  # fmt: skip
    T, D = normed.shape
    if scale.dim() != 2 or scale.shape[1] != D or not scale.is_contiguous() or scale.dtype != normed.dtype:
        raise ValueError(f"scale: expected a contiguous {normed.dtype} [L, {D}], got {scale.dtype} "
                         f"{tuple(scale.shape)}")  # fmt: skip
    lanes = scale.shape[0]
    if out is None:
        out = torch.empty(lanes, T, D, dtype=normed.dtype, device=normed.device)
    elif out.shape != (lanes, T, D) or not out.is_contiguous() or out.dtype != normed.dtype:
        raise ValueError(f"out: expected a contiguous {normed.dtype} [{lanes}, {T}, {D}], got {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    if T:
        _lane_scale_kernel[(T,)](normed, scale, out, T, LANES=lanes, D=D, BLOCK_D=triton.next_power_of_2(D),
                                 num_warps=4)  # fmt: skip
    return out
