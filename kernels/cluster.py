"""Thread-block clusters for plain Triton kernels on Hopper: a launch that groups programs into clusters, and
the helpers with which the programs of a cluster hand each other data through shared memory, without an atomic
arrival counter.

Triton's own `num_ctas` makes one program span the CTAs of a cluster (its tensors split across them). Here
every program stays one CTA: the kernel is compiled as usual and launched with a cluster dimension along x,
so program_id(0) = cluster * size + rank, and a cluster's programs are resident together on one GPC.

Programs write straight into each other's shared memory (the exchange helpers below): a program arms an mbarrier
with the bytes it expects, peers push data to it with st.async, and it waits for its own mbarrier, so no store
needs a GPU-scope release first. Nothing here runs under the interpreter: kernels keep another path for it.
"""

import ctypes

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

CLUSTER_SIZES = (1, 2, 4, 8, 16)  # 16 is non-portable; the H100 and H200 allow it
_DEFAULT_DYNAMIC_SHARED = 48 * 1024  # what a launch may take without the function's opt-in
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute
_opted_in: set[tuple[int, int]] = set()


def _allow_dynamic_shared(function: int, nbytes: int) -> None:
    """Opt a loaded kernel in to `nbytes` of dynamic shared memory (cuFuncSetAttribute), once."""
    if (function, nbytes) in _opted_in:
        return
    libcuda = ctypes.CDLL("libcuda.so.1")
    status = libcuda.cuFuncSetAttribute(
        ctypes.c_void_p(function), ctypes.c_int(_MAX_DYNAMIC_SHARED_SIZE_BYTES), ctypes.c_int(nbytes)
    )
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute: {nbytes} bytes of dynamic shared memory refused (CUDA error "
                           f"{status})")  # fmt: skip
    _opted_in.add((function, nbytes))


def launch_clusters(
    kernel: JITFunction, clusters: int, size: int, args: tuple, kwargs: dict, exchange_bytes: int = 0
) -> None:
    """kernel[(clusters * size,)](*args, **kwargs) with the programs grouped into clusters of `size` along x
    (at most 8, or 16 where the device allows non-portable clusters, as the H100 / H200 do). kwargs must name
    every parameter not in args (and may add launch options such as num_warps and launch_pdl). exchange_bytes:
    dynamic shared memory each program gets past the kernel's own, for exchange_region."""
    if size not in CLUSTER_SIZES:
        raise ValueError(f"size: expected a cluster of {CLUSTER_SIZES} programs, got {size}")
    compiled = kernel.warmup(*args, grid=(clusters * size,), **kwargs)
    values = list(args) + [kwargs[name] for name in kernel.arg_names[len(args) :]]
    num_warps, _, shared = compiled.packed_metadata
    stream = torch.cuda.current_stream(torch.cuda.current_device()).cuda_stream
    launch = compiled.run  # loads the kernel: compiled.function is its handle from here on
    if shared <= _DEFAULT_DYNAMIC_SHARED < shared + exchange_bytes:
        # Triton opts a kernel in to more than 48 KiB only for its own needs past them.
        _allow_dynamic_shared(compiled.function, shared + exchange_bytes)
    # Triton's launcher takes the cluster size in the metadata it is given and multiplies grid x by it.
    launch(clusters, 1, 1, stream, compiled.function, (num_warps, size, shared + exchange_bytes), None, None,
           None, *values)  # fmt: skip


# Distributed shared memory exchange (decode_attention's push merge). Each program of a cluster owns a region of
# `alloc` bytes of dynamic shared memory past Triton's own: launch_clusters asks for them beyond the compiled
# kernel's allocation, and the region is found from the end of it (%dynamic_smem_size), 16-byte aligned. Its
# first 8 bytes are an mbarrier that counts the bytes peers push into the region (st.async ... complete_tx), so
# a program knows its inbox is full without a cluster barrier, and no store waits for a GPU-scope release.
_REGION = tl.constexpr(
    "{ .reg .u32 a, s; mov.u32 a, global_smem; mov.u32 s, %dynamic_smem_size; add.u32 a, a, s; "
    "sub.u32 a, a, $1; add.u32 a, a, 15; and.b32 $0, a, -16; }"
)
# Thread 0 sets up the mbarrier for one arrival (its own) and $2 bytes, and makes the set-up visible to the
# cluster; then every thread arrives at the cluster barrier without waiting (exchange_ready waits).
_ARM = tl.constexpr(
    "{ .reg .pred p; .reg .u32 t; .reg .b64 st; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
    "@p mbarrier.init.shared::cta.b64 [$1], 1; "
    "@p mbarrier.arrive.expect_tx.shared::cta.b64 st, [$1], $2; "
    "@p fence.mbarrier_init.release.cluster; "
    "barrier.cluster.arrive.relaxed.aligned; mov.u32 $0, 0; }"
)
_READY = tl.constexpr("barrier.cluster.wait.aligned; mov.u32 $0, $1;")  # acquire: every peer armed its inbox
# VEC fp32 from this program's shared address $1 to the same offset ($2, this program's address) of program
# $3's region, counted by that program's mbarrier ($5, this program's address), where $4 is not 0.
_PUSH_HEAD = "{ .reg .pred p; .reg .u32 r, b; .reg .f32 x, y, z, w; setp.ne.u32 p, $4, 0; "
_PUSH_MAP = "@p mapa.shared::cluster.u32 r, $2, $3; @p mapa.shared::cluster.u32 b, $5, $3; "
_PUSH_ASYNC = "@p st.async.shared::cluster.mbarrier::complete_tx::bytes"
_PUSH1 = tl.constexpr(
    _PUSH_HEAD + "@p ld.shared.f32 x, [$1]; " + _PUSH_MAP + _PUSH_ASYNC + ".f32 [r], x, [b]; mov.u32 $0, 0; }"
)
_PUSH2 = tl.constexpr(
    _PUSH_HEAD
    + "@p ld.shared.v2.f32 {x, y}, [$1]; "
    + _PUSH_MAP
    + _PUSH_ASYNC
    + ".v2.f32 [r], {x, y}, [b]; mov.u32 $0, 0; }"
)
_PUSH4 = tl.constexpr(
    _PUSH_HEAD
    + "@p ld.shared.v4.f32 {x, y, z, w}, [$1]; "
    + _PUSH_MAP
    + _PUSH_ASYNC
    + ".v4.f32 [r], {x, y, z, w}, [b]; mov.u32 $0, 0; }"
)
_STORE_LOCAL = tl.constexpr(
    "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p st.shared.f32 [$1], $2; mov.u32 $0, 0; }"
)
_LOAD_LOCAL = tl.constexpr("ld.shared.f32 $0, [$1];")
# 1 once the inbox's mbarrier finished phase 0 (every byte pushed to it has landed), else 0 after a while.
_INBOX_FULL = tl.constexpr(
    "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$1], 0; "
    "selp.u32 $0, 1, 0, p; }"
)


@triton.jit
def exchange_region(alloc):
    """This program's exchange region: its shared address (int32), 16-byte aligned, `alloc` bytes (an int32
    scalar) from the end of the dynamic allocation (16 of them slack for the alignment)."""
    return tl.inline_asm_elementwise(_REGION, "=r,r", [alloc], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def exchange_arm(region, inbox_bytes):
    """Set up the region's mbarrier to expect `inbox_bytes` and arrive at the cluster barrier (every thread
    of every program of the cluster must call it once). Returns a token for exchange_ready."""
    return tl.inline_asm_elementwise(_ARM, "=r,r,r", [region, inbox_bytes], dtype=tl.int32, is_pure=False,
                                     pack=1)  # fmt: skip


@triton.jit
def exchange_ready(token):
    """Wait until every program of the cluster has armed its inbox (it may be pushed to from then on)."""
    return tl.inline_asm_elementwise(_READY, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_local(addr, value, keep):
    """fp32 `value` at this program's shared address `addr` where `keep` (int32) is not 0."""
    return tl.inline_asm_elementwise(_STORE_LOCAL, "=r,r,f,r", [addr, value, keep], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def load_local(addr):
    """fp32 at this program's shared address `addr`."""
    return tl.inline_asm_elementwise(_LOAD_LOCAL, "=f,r", [addr], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def push(local, remote, rank, keep, mbarrier, VEC: tl.constexpr):
    """VEC (1, 2 or 4) fp32 at this program's shared address `local` into program `rank`'s region at the
    offset `remote` has in this program's, counted by that program's mbarrier (the offset `mbarrier` has here),
    where `keep` is not 0. One element of `local` a thread: a tensor that replicates elements across threads
    would push them twice."""
    args = [local, remote, rank, keep, mbarrier]
    if VEC == 4:
        done = tl.inline_asm_elementwise(_PUSH4, "=r,r,r,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)
    elif VEC == 2:
        done = tl.inline_asm_elementwise(_PUSH2, "=r,r,r,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)
    else:
        done = tl.inline_asm_elementwise(_PUSH1, "=r,r,r,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)
    return done


@triton.jit
def wait_inbox(mbarrier):
    """Wait until every byte pushed to this program's inbox has landed (acquire); returns 1."""
    full = tl.inline_asm_elementwise(_INBOX_FULL, "=r,r", [mbarrier], dtype=tl.int32, is_pure=False, pack=1)
    while full == 0:
        full = tl.inline_asm_elementwise(_INBOX_FULL, "=r,r", [mbarrier], dtype=tl.int32, is_pure=False,
                                         pack=1)  # fmt: skip
    return full
