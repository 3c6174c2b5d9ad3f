"""Add the other lanes' partials of the same layer into a group of lanes' residual: the second half of an
immediate cross-lane sum whose lanes live on several devices.

    x[l, n] += sum_m p[m, n] - p[lane_start + l, n]      (m over all T lanes; l over the group's G)

The group's launch of lane_reduce_gemv added its own partials (a DELAYED launch over zero history) and stored
them in p; the other devices' rows of p arrived through the lane exchange. Summing all T rows and taking the
lane's own back out keeps one sum per column for every lane, in the same order on every device.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import pdl_kwargs


@triton.jit
def _lane_sum_add_kernel(
    x_ptr, p_ptr, N, lane_start, G: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for m in tl.static_range(T):
        total += tl.load(p_ptr + m * N + offs, mask=mask, other=0.0)
    for lane in tl.static_range(G):
        own = tl.load(p_ptr + (lane_start + lane) * N + offs, mask=mask, other=0.0)
        x = tl.load(x_ptr + lane * N + offs, mask=mask, other=0.0)
        tl.store(x_ptr + lane * N + offs, x + (total - own), mask=mask)


def lane_sum_add(
    x: torch.Tensor, partials: torch.Tensor, lane_start: int, use_pdl: bool = False
) -> torch.Tensor:
    """x [G, N] fp32 (lanes lane_start .. lane_start + G - 1 of T), updated in place from partials [T, N] fp32."""
    if x.dim() != 2 or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"x: expected a contiguous fp32 [G, N], got {x.dtype} {tuple(x.shape)}")
    lanes, n = x.shape
    if (
        partials.dim() != 2
        or partials.shape[1] != n
        or not partials.is_contiguous()
        or partials.dtype != x.dtype
    ):
        raise ValueError(
            f"partials: expected a contiguous fp32 [T, {n}], got {partials.dtype} {tuple(partials.shape)}"
        )
    total = partials.shape[0]
    if not 0 <= lane_start <= total - lanes:
        raise ValueError(
            f"lane_start: lanes {lane_start} .. {lane_start + lanes - 1} are not within {total} lanes"
        )
    block = min(1024, triton.next_power_of_2(n))
    _lane_sum_add_kernel[(triton.cdiv(n, block),)](
        x, partials, n, lane_start, G=lanes, T=total, BLOCK=block, USE_PDL=use_pdl, **pdl_kwargs(use_pdl)
    )
    return x
