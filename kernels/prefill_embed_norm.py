"""The prefill's first step in one pass: each prompt position's embedding row, the first layer's attention norm
of it, and that norm's scale for every lane.

    embedded[t] = table[ids[t]]
    h[l, t, d]  = round(scale[l, d] * round(embedded[t, d] / rms(embedded[t])))     rms in fp32

with the roundings model.rms_norm makes (normalised in fp32, cast to the dtype, then scaled). The lanes all
start from the same embedding rows, so the norm is taken once a position and only the per-lane scale spreads
it to [L, T, D].

Why one kernel: eagerly this was an embedding gather, an fp32 copy, F.rms_norm, a cast back and the lane
scale, five launches before the first matrix product of a prompt. At 4,094 tokens the GPU finishes each of
them before the host has queued the next, so the first q|k|v product waited on the host's launches: the
prefill's start is bound by the host, not the GPU.

Grid: one program a position t. It reads its row once (16-byte vectors: D is a constexpr, a multiple of 8
in the models here), sums the squares in fp32 and writes the row of every lane.
"""

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _prefill_embed_norm_kernel(ids_ptr, table_ptr, scale_ptr, embedded_ptr, h_ptr, T, eps, LANES: tl.constexpr,
                               D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    row = tl.load(ids_ptr + t).to(tl.int64)
    x = tl.load(table_ptr + row * D + d, mask=mask, other=0.0)
    tl.store(embedded_ptr + t * D + d, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)  # cast back before the scale
    for lane in tl.static_range(LANES):
        s = tl.load(scale_ptr + lane * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + (lane * T + t) * D + d, (s * normed).to(h_ptr.dtype.element_ty), mask=mask)


def prefill_embed_norm(ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(embedded [T, D], h [L, T, D]): the rows of table [V, D] at ids [T], and their RMSNorm scaled by each
    lane's row of scale [L, D] (the first layer's attention norm), rounded as model.rms_norm rounds it.

    ids: int32/int64 on table's device, each in [0, V) (the caller checks: the kernel does not); table, scale:
    contiguous, of one dtype (fp32, fp16 or bf16)."""
    if table.dim() != 2 or not table.is_contiguous() or table.dtype not in DTYPES:
        raise ValueError(f"table: expected a contiguous fp32/fp16/bf16 [V, D], got {table.dtype} "
                         f"{tuple(table.shape)}")  # fmt: skip
    D = table.shape[1]
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != table.device:
        raise ValueError(f"ids: expected int32/int64 [T] on {table.device}, got {ids.dtype} {tuple(ids.shape)} "
                         f"on {ids.device}")  # fmt: skip
    if scale.dim() != 2 or scale.shape[1] != D or not scale.is_contiguous() or scale.dtype != table.dtype:
        raise ValueError(f"scale: expected a contiguous {table.dtype} [L, {D}], got {scale.dtype} "
                         f"{tuple(scale.shape)}")  # fmt: skip
    lanes, T = scale.shape[0], ids.shape[0]
    embedded = torch.empty(T, D, dtype=table.dtype, device=table.device)
    h = torch.empty(lanes, T, D, dtype=table.dtype, device=table.device)
    if T:
        _prefill_embed_norm_kernel[(T,)](ids, table, scale, embedded, h, T, eps, LANES=lanes, D=D,
                                         BLOCK_D=triton.next_power_of_2(D), num_warps=4)  # fmt: skip
    return embedded, h
