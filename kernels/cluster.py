"""Thread-block clusters for plain Triton kernels on Hopper: a launch that groups programs into clusters, and
the PTX a program needs to trade small values with the other programs of its cluster through distributed
shared memory (DSMEM) instead of a round trip through L2 and an atomic counter.

Triton's own `num_ctas` makes one program span the CTAs of a cluster (tensors split across them). Here every
program stays one CTA: the kernel is compiled as usual and launched with a cluster dimension along x, so
program_id(0) = cluster * size + rank. Each program gets `exchange_bytes` of dynamic shared memory past
Triton's own, addressed from the end of the allocation (`%dynamic_smem_size`), so Triton's buffers and the
exchange never overlap.

The jit helpers take byte offsets into the exchange region as int32 tensors and work element by element, so
they fit any register layout. A program may touch a peer's shared memory only while the peer is running: the
kernel arrives at the cluster barrier early and waits before its first remote store (every peer has started),
and pushes (remote stores, then a sync, then local loads), so that no program reads a peer that may have
exited. None of this runs under the interpreter: kernels keep another path for it.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# The region's address: global_smem is Triton's dynamic shared memory and the exchange its last bytes; $1
# counts back from the end (offset - the region's size: negative, the 32-bit wrap-around is intended).
_REGION = "mov.u32 a, global_smem; mov.u32 s, %dynamic_smem_size; add.u32 a, a, s; add.u32 a, a, $1; "
_PUT = tl.constexpr(
    "{ .reg .u32 a, s, r; .reg .pred p; "
    + _REGION
    + "setp.ne.u32 p, $4, 0; mapa.shared::cluster.u32 r, a, $3; "
    "@p st.shared::cluster.f32 [r], $2; mov.u32 $0, 0; }"
)
_GET = tl.constexpr("{ .reg .u32 a, s; " + _REGION + "ld.shared.f32 $0, [a]; }")
_ARRIVE = tl.constexpr("barrier.cluster.arrive.relaxed.aligned; mov.u32 $0, $1;")
_WAIT = tl.constexpr("barrier.cluster.wait.aligned; mov.u32 $0, $1;")  # acquire
_SYNC = tl.constexpr(
    "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, $1;"
)


@triton.jit
def exchange_put(back, value, rank, keep):
    """Store fp32 `value` at exchange offset `back` (bytes, minus the region's size) of the cluster's program
    `rank`, where `keep` (int32) is not 0."""
    return tl.inline_asm_elementwise(
        _PUT, "=r,r,f,r,r", [back, value, rank, keep], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def exchange_get(back):
    """fp32 at exchange offset `back` of this program's own region."""
    return tl.inline_asm_elementwise(_GET, "=f,r", [back], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def cluster_arrive(token):
    """This thread arrives at the cluster barrier without ordering memory (pair it with cluster_wait)."""
    return tl.inline_asm_elementwise(_ARRIVE, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cluster_wait(token):
    """Wait until every thread of the cluster has arrived (acquire)."""
    return tl.inline_asm_elementwise(_WAIT, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cluster_sync(token):
    """Every thread of every program in the cluster arrives (release: its shared-memory stores before it) and
    waits for all (acquire). Each helper returns `token`, so that what depends on the result comes after."""
    return tl.inline_asm_elementwise(_SYNC, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


def launch_clusters(
    kernel: JITFunction, clusters: int, size: int, exchange_bytes: int, args: tuple, kwargs: dict
) -> None:
    """kernel[(clusters * size,)](*args, **kwargs) with the programs grouped into clusters of `size` along x
    (at most 8, or 16 where the device allows non-portable clusters, as the H200 does) and `exchange_bytes`
    more dynamic shared memory each. kwargs must name every parameter not in args (and may add launch
    options such as num_warps and launch_pdl)."""
    if size not in (1, 2, 4, 8, 16):
        raise ValueError(f"size: expected a cluster of 1, 2, 4, 8 or 16 programs, got {size}")
    compiled = kernel.warmup(*args, grid=(clusters * size,), **kwargs)
    names = kernel.arg_names
    values = list(args) + [kwargs[name] for name in names[len(args) :]]
    num_warps, _, shared = compiled.packed_metadata
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    # The launcher multiplies grid x by the cluster size it is given.
    compiled.run(clusters, 1, 1, stream, compiled.function, (num_warps, size, shared + exchange_bytes),
                 None, None, None, *values)  # fmt: skip
