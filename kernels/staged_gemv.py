"""RMSNorm + matrix-vector product with the weights staged in shared memory by the bulk copy engine (Gluon, Hopper).

    out[n] = epilogue( sum_k W[n, k] * x[k] * g[k] * rstd ),   rstd = 1 / sqrt(mean_k x[k]^2 + eps)

Epilogues: none (q|k|v), silu(W x) * (W_up x) (gate/up), or out[n] += W x with out the fp32 residual and no norm
(the o-proj and down-proj of a one-lane model, whose reduction is the plain residual add).

The same arithmetic as rmsnorm_gemv for one lane, streamed differently. A program owns ROW_GROUPS groups of BOX_R
rows and walks them in boxes of [BOX_R, BOX_K] weights (gate and up boxes together with the SiLU epilogue)
through a ring of STAGES shared-memory buffers filled by TMA copies (`cp.async.bulk.tensor`, one thread issues,
an mbarrier counts the bytes in).

Why: the register-tiled kernels can only keep in flight what their registers hold, and registers are what the
kernel running before them needs too, so across a kernel boundary the stream drains and restarts. Here a waiting
program holds its first STAGES boxes in shared memory and needs few registers, so it can sit resident beside the
previous kernel (programmatic dependent launch) with up to STAGES * box bytes of its weights already moving, and
the stream goes on through the boundary. Hopper only: no interpreter twin (tests run it on the GPU against
rmsnorm_gemv and a PyTorch reference).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import pdl_kwargs, sm_count


@gluon.jit
def _issue_box(w_desc, u_desc, w_ring, u_ring, bars, chunk, row0, KB: gl.constexpr, BOX_R: gl.constexpr,
               BOX_C: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr):  # fmt: skip
    """Start the copy of box `chunk` (row group chunk // KB, column block chunk % KB) into ring stage
    chunk % STAGES. A box is [BOX_R rows, BOX_C, BK]: each row's BOX_C * BK elements are contiguous in memory."""
    stage = chunk % STAGES
    row = row0 + (chunk // KB) * BOX_R
    col = (chunk % KB) * BOX_C
    bar = bars.index(stage)
    if GATED:
        mbarrier.expect(bar, 2 * BOX_R * BOX_C * BK * 2)
        tma.async_copy_global_to_shared(w_desc, [row, col, 0], bar, w_ring.index(stage))
        tma.async_copy_global_to_shared(u_desc, [row, col, 0], bar, u_ring.index(stage))
    else:
        mbarrier.expect(bar, BOX_R * BOX_C * BK * 2)
        tma.async_copy_global_to_shared(w_desc, [row, col, 0], bar, w_ring.index(stage))


@gluon.jit
def _staged_gemv_kernel(
    w_desc,
    u_desc,
    x_ptr,
    norm_ptr,
    out_ptr,
    N,
    eps,
    K: gl.constexpr,
    BOX_R: gl.constexpr,
    BOX_C: gl.constexpr,
    BK: gl.constexpr,
    ROW_GROUPS: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_NORM: gl.constexpr,
    GATED: gl.constexpr,
    RESIDUAL: gl.constexpr,
    USE_PDL: gl.constexpr,
    TRIGGER_EARLY: gl.constexpr,
):
    KB: gl.constexpr = K // (BOX_C * BK)  # column blocks a row group
    CHUNKS: gl.constexpr = ROW_GROUPS * KB
    # [BOX_R, BOX_C, BK] box in registers: 16 contiguous bytes a thread, a warp along BK columns, warps across
    # the box's BOX_C column slices.
    WARPS_C: gl.constexpr = BOX_C if gl.num_warps() > BOX_C else gl.num_warps()
    box: gl.constexpr = gl.BlockedLayout(
        [1, 1, 8], [1, 32 * 8 // BK, BK // 8], [gl.num_warps() // WARPS_C, WARPS_C, 1], [2, 1, 0]
    )
    x_layout: gl.constexpr = gl.SliceLayout(0, box)  # [BOX_C, BK]
    rows_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, box))  # [BOX_R]

    row0 = gl.program_id(0) * (ROW_GROUPS * BOX_R)
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BOX_R, BOX_C, BK], w_desc.layout)
    if GATED:
        u_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BOX_R, BOX_C, BK], u_desc.layout)
    else:
        u_ring = w_ring
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()

    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    # The first STAGES boxes are in flight before we wait for the kernel that produces x.
    for c in gl.static_range(STAGES):
        if c < CHUNKS:
            _issue_box(w_desc, u_desc, w_ring, u_ring, bars, c, row0, KB, BOX_R, BOX_C, BK, STAGES, GATED)
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()

    # x (times g) by column blocks, in registers for the whole kernel: a tuple of KB [BOX_C, BK] fp32 tiles, all
    # loaded at once, so that no load's latency sits inside the loop over the boxes.
    slices = gl.arange(0, BOX_C, layout=gl.SliceLayout(1, x_layout))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
    x_offs = gl.expand_dims(slices, 1) * BK + gl.expand_dims(cols, 0)
    xs = ()
    for i in gl.static_range(KB):
        xs = xs + (gl.load(x_ptr + i * BOX_C * BK + x_offs).to(gl.float32),)
    if HAS_NORM:
        sumsq = gl.zeros([BOX_C, BK], gl.float32, layout=x_layout)
        for i in gl.static_range(KB):
            sumsq += xs[i] * xs[i]
        rstd = 1.0 / gl.sqrt(gl.sum(gl.sum(sumsq, axis=1), axis=0) / K + eps)
        normed = ()
        for i in gl.static_range(KB):
            normed = normed + (xs[i] * gl.load(norm_ptr + i * BOX_C * BK + x_offs).to(gl.float32),)
        xs = normed
    else:
        rstd = 1.0

    for group in range(ROW_GROUPS):
        acc = gl.zeros([BOX_R, BOX_C, BK], gl.float32, layout=box)
        acc_up = gl.zeros([BOX_R, BOX_C, BK], gl.float32, layout=box)
        for kb in gl.static_range(KB):
            chunk = group * KB + kb
            stage = chunk % STAGES
            xk = gl.expand_dims(xs[kb], 0)
            mbarrier.wait(bars.index(stage), (chunk // STAGES) & 1)
            acc += w_ring.index(stage).load(box).to(gl.float32) * xk
            if GATED:
                acc_up += u_ring.index(stage).load(box).to(gl.float32) * xk
            if CHUNKS > STAGES:  # a ring: once every warp has read this stage, refill it STAGES boxes on
                gl.thread_barrier()
                if chunk + STAGES < CHUNKS:
                    _issue_box(w_desc, u_desc, w_ring, u_ring, bars, chunk + STAGES, row0, KB, BOX_R, BOX_C, BK,
                               STAGES, GATED)  # fmt: skip
        rows = row0 + group * BOX_R + gl.arange(0, BOX_R, layout=rows_layout)
        y = gl.sum(gl.sum(acc, axis=2), axis=1) * rstd
        if GATED:
            y = y / (1.0 + gl.exp(-y)) * (gl.sum(gl.sum(acc_up, axis=2), axis=1) * rstd)
        if RESIDUAL:  # out is the fp32 residual stream: out += y
            y += gl.load(out_ptr + rows, mask=rows < N, other=0.0)
        gl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def staged_layout() -> gl.NVMMASharedLayout:
    """Unswizzled boxes: a warp reads one row's 512 contiguous bytes, which no swizzle would make faster."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)


def pick_staging(n: int, k: int, gated: bool, device: torch.device) -> tuple[int, int, int, int, int]:
    """(box_r, box_c, bk, row_groups, stages): boxes of 8 KiB as 4 rows x 2 KiB runs (contiguous in memory), at most
    one program a multiprocessor with an even share of rows, and a ring of ~128 KiB, which also keeps a second
    program of the same kernel off a multiprocessor (two would share its bandwidth while others idle)."""
    bk = 256
    while k % bk:
        bk //= 2
    box_c = 1
    while box_c < 4 and k % (bk * box_c * 2) == 0:
        box_c *= 2
    box_r = max(1, 4096 // (box_c * bk))
    while n % box_r:
        box_r //= 2
    row_groups = triton.cdiv(triton.cdiv(n, box_r), sm_count(device))
    box_bytes = box_r * box_c * bk * 2 * (2 if gated else 1)
    stages = max(2, 131072 // box_bytes)  # even where fewer boxes than that make a program's share
    return box_r, box_c, bk, row_groups, stages


def staged_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_up: torch.Tensor | None = None,
    residual: bool = False,
    use_pdl: bool = False,
    trigger_early: bool = False,
    box_r: int | None = None,
    box_c: int | None = None,
    stages: int | None = None,
    share_kb: int | None = None,
    num_warps: int = 4,
    descriptors: dict | None = None,
) -> torch.Tensor:
    """out [N] = W @ (rmsnorm(x) * norm_weight), or silu(W @ h) * (W_up @ h) with weight_up, or with residual
    (out fp32, no norm, no weight_up) out += W @ x; one lane.

    x: [K] (any float dtype); weight, weight_up: [N, K] bf16, contiguous; out: [N]. descriptors: a dict the
    caller keeps to reuse the TMA descriptors (keyed by the weights' addresses and the box)."""
    if weight.dim() != 2 or not weight.is_contiguous() or weight.dtype != torch.bfloat16:
        raise ValueError(
            f"weight: expected a contiguous bf16 [N, K], got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if weight_up is not None and (weight_up.shape != weight.shape or not weight_up.is_contiguous()
                                  or weight_up.dtype != torch.bfloat16):  # fmt: skip
        raise ValueError(f"weight_up: expected a contiguous bf16 {tuple(weight.shape)}")
    if x.shape != (k,) or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [{k}], got {tuple(x.shape)}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight: expected [{k}], got {tuple(norm_weight.shape)}")
    if out.shape != (n,) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{n}], got {tuple(out.shape)}")
    if residual and (out.dtype != torch.float32 or norm_weight is not None or weight_up is not None):
        raise ValueError("residual: out must be the fp32 residual, with no norm and no weight_up")
    if k % 8:
        raise ValueError(f"staged_gemv: K {k} must be a multiple of 8 (TMA rows of 16-byte multiples)")
    auto_r, auto_c, bk, _, auto_stages = pick_staging(n, k, weight_up is not None, weight.device)
    box_c = box_c or auto_c
    if share_kb:
        # Many small programs, each with its whole share of rows in flight at once (no ring to refill): the block
        # scheduler balances them, and as many as fit sit resident beside the previous kernel, loading.
        row_bytes = k * 2 * (2 if weight_up is not None else 1)
        rows = max(1, share_kb * 1024 // row_bytes)
        box_r = box_r or min(8, 1 << (rows.bit_length() - 1))
        while n % box_r:
            box_r //= 2
        row_groups = max(1, rows // box_r)
        stages = row_groups * (k // (box_c * bk))
    else:
        box_r = box_r or auto_r
        row_groups = triton.cdiv(triton.cdiv(n, box_r), sm_count(weight.device))
        if stages is None:
            stages = auto_stages * auto_r * auto_c // (box_r * box_c)  # the same ring bytes
    if n % box_r or k % (box_c * bk):
        raise ValueError(
            f"staged_gemv: N {n} and K {k} must be multiples of the box's {box_r} rows x {box_c * bk}"
        )
    layout = staged_layout()

    def descriptor(t: torch.Tensor) -> TensorDescriptor:
        """A TMA descriptor of t viewed as [N, K / bk, bk]: a box's rows are runs of box_c * bk elements."""
        key = (t.data_ptr(), tuple(t.shape), box_r, box_c, bk)
        if descriptors is not None and key in descriptors:
            return descriptors[key]
        desc = TensorDescriptor.from_tensor(t.view(n, k // bk, bk), [box_r, box_c, bk], layout)
        if descriptors is not None:
            descriptors[key] = desc
        return desc

    w_desc = descriptor(weight)
    u_desc = descriptor(weight_up) if weight_up is not None else w_desc
    grid = (triton.cdiv(n, box_r * row_groups),)
    _staged_gemv_kernel[grid](
        w_desc,
        u_desc,
        x,
        norm_weight if norm_weight is not None else x,
        out,
        n,
        eps,
        K=k,
        BOX_R=box_r,
        BOX_C=box_c,
        BK=bk,
        ROW_GROUPS=row_groups,
        STAGES=max(2, stages),
        HAS_NORM=norm_weight is not None,
        GATED=weight_up is not None,
        RESIDUAL=residual,
        USE_PDL=use_pdl,
        TRIGGER_EARLY=trigger_early,
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    return out
