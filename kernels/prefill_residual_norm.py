"""Prefill's block boundary in one pass: the lane reduction of a block's partials into the residual streams,
then the next block's RMSNorm.

    x_out[l, t] = x[l, t] + reduce(partial, past)[l, t]
    h[l, t]     = norm_weight[l] * rmsnorm(x_out[l, t])        (fp32 statistics, rounded as the reference does)

with reduce as model.Transformer.reduce (the runner's `reduction` modes):
    sum      sum over lanes of partial[:, t]                (one lane: the partial itself)
    scaled   partial[l, t] * sqrt(L)
    delayed  partial[l, t] + sum over lanes of past[:, t] - past[l, t]   (past: the raw partials d layers back)

In eager PyTorch this boundary is ~8 launches over [L, T, D] tensors (casts, the lane sum, adds, the norm's
fp32 copy), which at 4,096 tokens of a Laneformer costs more GPU time than all the matrix products. (A verify
step's few positions take _row_residual_norm_kernel instead: there this kernel's chunk loops are its time.) Here each
program owns one position t for all lanes (the lane sum needs them together) and makes two passes over its
[L, D] row in [LP, BLOCK_D] chunks: the sums and the new residual (stored, and its squares summed), then the
norm from the row it just wrote, read back from L2. (The whole row in registers instead, 8 lanes * 3,072 with
its three inputs, is ~150 KB: one program a multiprocessor, idle memory while it computes.)

What keeps the memory busy (the first version held one [8, 512] chunk a program at a time, load -> use ->
store, and left the memory idle between them): both loops are software-pipelined by Triton (tl.range with
num_stages): the next STAGES - 1 chunks are copied asynchronously (cp.async) into shared memory while the
current one is summed, so in-flight bytes cost no registers. Chunks of [8, 1024] on 4 warps (default_blocks)
keep 2 * 48 KB of bf16 inputs a program in flight; smaller chunks keep too few bytes in flight.
While some programs wait on HBM in their first pass, others read L2 in their second. Lane offsets are 64-bit
once per program, offsets inside a row 32-bit.

Bytes (laneformer-2b, T = 4,094, bf16 residual as the runner keeps it): x, partial (and past) read once,
x_out and h written once: 5 * 8 * 4,094 * 3,072 * 2 B = 1.0 GB delayed, 0.8 GB otherwise; an fp32
residual would add 0.4 GB read and 0.2 GB written. The second pass re-reads
x_out from L2, not HBM.
"""

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs

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
    T,
    lanes,
    scale,
    eps,
    D: tl.constexpr,
    LP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr,
    MODE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # every program waits: the chain of dependencies stays transitive
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, LP)
    lane_ok = lane < lanes
    cols = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + lane.to(tl.int64) * stride_x_lane + t * stride_x_t  # [LP] row starts (x may broadcast)
    dense_rows = (lane.to(tl.int64) * T + t) * D  # [LP] row starts in a contiguous [L, T, D]
    out_rows = x_out_ptr + dense_rows

    # Pass 1: x_out = x + reduce(partial, past), and the squares of x_out as stored. STAGES - 1 chunks ahead
    # are in flight (copied asynchronously into shared memory by Triton's pipeliner).
    sumsq = tl.zeros([LP], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        d = d0 + cols
        mask = lane_ok[:, None] & (d < D)[None, :]
        x = tl.load(x_rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        p = tl.load(partial_ptr + dense_rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            add = tl.sum(p, axis=0)[None, :] + tl.zeros_like(p)
        elif MODE == 1:
            add = p * scale
        else:
            old = tl.load(past_ptr + dense_rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
            add = p + tl.sum(old, axis=0)[None, :] - old
        new = (x + add).to(x_out_ptr.dtype.element_ty)
        tl.store(out_rows[:, None] + d[None, :], new, mask=mask)
        new_f = new.to(tl.float32)
        sumsq += tl.sum(new_f * new_f, axis=1)

    # Pass 2: h = norm_weight * rmsnorm(x_out), from the row just written (L2).
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(sumsq / D + eps)
        tl.debug_barrier()  # the row this program's threads just wrote is read back by other threads
        norm_rows = norm_ptr + lane * D
        h_rows = h_ptr + dense_rows
        for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
            d = d0 + cols
            mask = lane_ok[:, None] & (d < D)[None, :]
            new = tl.load(out_rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(norm_rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
            normed = (new * rstd[:, None]).to(h_ptr.dtype.element_ty)  # rounded as model.rms_norm rounds it
            tl.store(h_rows[:, None] + d[None, :], (w * normed.to(tl.float32)).to(normed.dtype), mask=mask)


@triton.jit
def _row_residual_norm_kernel(
    x_ptr,
    stride_x_lane,
    stride_x_t,
    partial_ptr,
    past_ptr,
    norm_ptr,
    x_out_ptr,
    h_ptr,
    T,
    scale,
    eps,
    D: tl.constexpr,
    DP: tl.constexpr,
    LANES: tl.constexpr,
    MODE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The same boundary for a few positions: a program per (position, lane) holds its whole row [DP] in registers
    and reads the other lanes' rows for the sums one row at a time, all loads issued before any is used, so a
    program waits on memory about twice (its inputs, then its norm) instead of once a chunk and pass."""
    if USE_PDL:  # every program waits: the chain of dependencies stays transitive
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    lane = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, DP)
    ok = d < D
    row = (lane * T + t) * D  # this lane's row in a contiguous [L, T, D]
    x = tl.load(x_ptr + lane * stride_x_lane + t * stride_x_t + d, mask=ok, other=0.0).to(tl.float32)
    if MODE == 0:  # the sum over lanes of the partials
        add = tl.zeros([DP], dtype=tl.float32)
        for j in tl.static_range(LANES):
            add += tl.load(partial_ptr + (j * T + t) * D + d, mask=ok, other=0.0).to(tl.float32)
    elif MODE == 1:
        add = tl.load(partial_ptr + row + d, mask=ok, other=0.0).to(tl.float32) * scale
    else:  # own partial + the other lanes' partials d layers back
        old = tl.zeros([DP], dtype=tl.float32)
        for j in tl.static_range(LANES):
            old += tl.load(past_ptr + (j * T + t) * D + d, mask=ok, other=0.0).to(tl.float32)
        own = tl.load(past_ptr + row + d, mask=ok, other=0.0).to(tl.float32)
        add = tl.load(partial_ptr + row + d, mask=ok, other=0.0).to(tl.float32) + old - own
    new = (x + add).to(x_out_ptr.dtype.element_ty)
    tl.store(x_out_ptr + row + d, new, mask=ok)
    if HAS_NORM:
        new_f = new.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(new_f * new_f, axis=0) / D + eps)
        w = tl.load(norm_ptr + lane * D + d, mask=ok, other=0.0).to(tl.float32)
        normed = (new_f * rstd).to(h_ptr.dtype.element_ty)  # rounded as model.rms_norm rounds it
        tl.store(h_ptr + row + d, (w * normed.to(tl.float32)).to(normed.dtype), mask=ok)


ROW_POSITIONS = 32  # up to this many positions (a verify step's), a program a row (_row_residual_norm_kernel)
ROW_DIM = 8192  # of a row at most, for its registers


def default_blocks(lanes: int, dim: int, itemsize: int = 2) -> tuple[int, int, int]:
    """(BLOCK_D, num_warps, stages): chunks of 16 KB an input ([8, 1024] in bf16 at 8 lanes, one [1, 2048] row at
    one lane) on 4 warps, 2 chunks ahead in shared memory (3 * 3 * 16 KB a program with its three inputs): the
    fastest of the chunk, warp and stage counts tried (docs/fast-path.md). Under the interpreter: 128 columns,
    no pipeline."""
    if interpreted():
        return min(triton.next_power_of_2(dim), 128), 4, 1
    chunk = 16384 // itemsize  # elements of one input a stage
    block_d = min(triton.next_power_of_2(dim), max(64, chunk // triton.next_power_of_2(lanes)))
    return block_d, 4, 3


def prefill_residual_norm(
    x: torch.Tensor,
    partial: torch.Tensor,
    *,
    mode: str,
    past: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    block_d: int | None = None,
    num_warps: int | None = None,
    stages: int | None = None,
    row_programs: bool | None = None,
    use_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + reduce(partial, past), rmsnorm of that * norm_weight or None without norm_weight).

    x: [L, T, D] (lanes may be a broadcast view: stride 0), last dim contiguous; partial, past: contiguous
    [L, T, D] like x's dtype; norm_weight: [L, D]; mode: "sum" | "scaled" | "delayed" (needs past).
    block_d, num_warps, stages: override default_blocks (sweeps). row_programs: a program per position and lane
    (_row_residual_norm_kernel) rather than per position; None: up to ROW_POSITIONS positions of up to ROW_DIM.
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
    default_d, default_warps, default_stages = default_blocks(lanes, D, partial.element_size())
    block_d = block_d or default_d
    if block_d & (block_d - 1):
        raise ValueError(f"block_d: expected a power of two, got {block_d}")
    if stages is not None and stages < 1:
        raise ValueError(f"stages: expected >= 1, got {stages}")
    x_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x_out) if norm_weight is not None else None
    if row_programs is None:
        row_programs = T <= ROW_POSITIONS and D <= ROW_DIM
    if row_programs:
        dp = triton.next_power_of_2(D)
        launch = {} if interpreted() else {"num_warps": 4 if dp <= 4096 else 8}
        _row_residual_norm_kernel[(T, lanes)](
            x, x.stride(0), x.stride(1), partial, past if past is not None else partial,
            norm_weight if norm_weight is not None else partial, x_out, h if h is not None else x_out,
            T, math.sqrt(lanes), eps, D=D, DP=dp, LANES=lanes, MODE=MODES[mode],
            HAS_NORM=norm_weight is not None, USE_PDL=use_pdl, **launch, **pdl_kwargs(use_pdl),
        )  # fmt: skip
        return x_out, h
    _prefill_residual_norm_kernel[(T,)](
        x,
        x.stride(0),
        x.stride(1),
        partial,
        past if past is not None else partial,
        norm_weight if norm_weight is not None else partial,
        x_out,
        h if h is not None else x_out,
        T,
        lanes,
        math.sqrt(lanes),
        eps,
        D=D,
        LP=triton.next_power_of_2(lanes),
        BLOCK_D=block_d,
        STAGES=stages or default_stages,
        MODE=MODES[mode],
        HAS_NORM=norm_weight is not None,
        USE_PDL=use_pdl,
        num_warps=num_warps or default_warps,
        **pdl_kwargs(use_pdl),
    )
    return x_out, h
