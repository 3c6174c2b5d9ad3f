"""The MLP's gating in one pass: SiLU of the gate matmul's output times the up matmul's output.

    out[i] = round(round(silu(gate[i])) * up[i]),    silu(g) = g / (1 + exp(-g))   (fp32 arithmetic)

with round() to out's dtype, i.e. exactly the two roundings of the reference `F.silu(gate) * up` in that
dtype (eager F.silu computes in fp32 and stores its output in the dtype; the multiply then reads it back,
multiplies in fp32 and rounds again). Why reproduce the inner rounding rather than round once: it costs
nothing (a cast in registers, no bytes), and it makes the fast prefill bit-identical to the reference model
here on nearly every element (the exponentials may differ in their last fp32 bit), so the teacher-forced
check against the reference (relative error 2e-2) measures the other kernels' differences, not this one's;
rounding once would be closer to exact arithmetic by at most half a unit in the last place of the dtype per
element, which the reference itself does not have. In fp32 the inner rounding is a no-op.

Eager, this is two elementwise kernels and a temporary: silu reads gate and writes silu(gate), the multiply
reads that and up and writes out (3 reads + 2 writes of the tensor); here gate and up are read once and out
written once (out may be gate or up itself: every element is read before the same thread writes it).

Layout: gate, up and out are contiguous tensors of any rank, treated as flat vectors of N elements. A 1-D
grid of cdiv(N, BLOCK) programs; each program owns BLOCK consecutive elements, so each thread handles
BLOCK / (32 * num_warps) contiguous elements: VECTORS runs of 16 bytes (8 bf16/fp16, 4 fp32), each one
128-bit load or store. Every program but the last one loads without a mask (a mask whose bound is not known
to be a multiple of the vector width would split the loads into scalars); the last one masks its tail.
Offsets are 64-bit when N + BLOCK could pass 2**31 (the last program's offsets run up to N + BLOCK - 2),
32-bit otherwise.

Bytes (laneformer-2b prefill, T = 4,094, bf16): gate and up [8, 4,094, 1,536] read, out written once,
3 * 8 * 4,094 * 1,536 * 2 B = 302 MB a layer, against eager's 503 MB (five passes): the kernel is a plain stream
that runs close to the read bandwidth, and its bf16 output equals eager's (docs/fast-path.md).
"""

import torch
import triton
import triton.language as tl

from kernels import interpreted

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
VECTORS = 4  # 16-byte vectors per thread and program (the default BLOCK)
NUM_WARPS = 4


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, N, BLOCK: tl.constexpr, INT64: tl.constexpr):
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= N:  # a full block: no mask, so the loads and stores stay 16-byte vectors
        g = tl.load(gate_ptr + offs).to(tl.float32)
        u = tl.load(up_ptr + offs).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # rounded as F.silu's output is
        tl.store(out_ptr + offs, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty))
    else:  # the tail
        mask = offs < N
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)


def default_block(dtype: torch.dtype) -> int:
    """Elements a program: VECTORS 16-byte vectors for each of 32 * NUM_WARPS threads (4,096 bf16/fp16,
    2,048 fp32): blocks up to that size on 4 or 8 warps all streamed alike, larger ones more slowly. Under the
    interpreter, which runs programs one after another, 16,384 (fewer, larger programs)."""
    if interpreted():
        return 16384
    return 16 // dtype.itemsize * 32 * NUM_WARPS * VECTORS


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """out = silu(gate) * up, rounded as `F.silu(gate) * up` rounds it (see the module docstring).

    gate, up: contiguous tensors of one shape (any rank), dtype (fp32, fp16 or bf16) and device; out: a
    contiguous tensor like them (allocated when None; it may be gate or up itself, but not overlap them
    otherwise). block, num_warps: override default_block and NUM_WARPS (sweeps); block a power of two.
    Returns out.
    """
    if gate.dtype not in DTYPES:
        raise ValueError(f"gate: expected fp32, fp16 or bf16, got {gate.dtype}")
    for name, t in (("up", up), ("out", out)):
        if t is None:
            continue
        if t.shape != gate.shape:
            raise ValueError(f"{name}: expected gate's shape {tuple(gate.shape)}, got {tuple(t.shape)}")
        if t.dtype != gate.dtype:
            raise ValueError(f"{name}: expected gate's dtype {gate.dtype}, got {t.dtype}")
        if t.device != gate.device:
            raise ValueError(f"{name}: expected gate's device {gate.device}, got {t.device}")
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if out is None:
        out = torch.empty_like(gate)
    else:
        for name, t in (("gate", gate), ("up", up)):
            if out.data_ptr() != t.data_ptr() and _overlaps(out, t):
                raise ValueError(f"out: may be {name} itself but must not partly overlap it")
    block = block or default_block(gate.dtype)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 16, got {block}")
    n = gate.numel()
    if n == 0:
        return out
    _silu_mul_kernel[(triton.cdiv(n, block),)](
        gate, up, out, n, BLOCK=block, INT64=n + block > 2**31, num_warps=num_warps or NUM_WARPS
    )
    return out
