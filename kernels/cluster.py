"""Thread-block clusters for plain Triton kernels on Hopper: a launch that groups programs into clusters, and
the PTX a program needs to trade small values with the other programs of its cluster through distributed
shared memory (DSMEM) instead of a round trip through L2 and an atomic counter.

Triton's own `num_ctas` makes one program span the CTAs of a cluster (tensors split across them). Here every
program stays one CTA: the kernel is compiled as usual and launched with a cluster dimension along x, so
program_id(0) = cluster * size + rank. Each program gets `exchange_bytes` of dynamic shared memory past
Triton's own, addressed from the end of the allocation (`%dynamic_smem_size`), so Triton's buffers and the
exchange never overlap.

The jit helpers take byte offsets into the exchange region as int32 tensors and work element by element, so
they fit any register layout: a program reading its peers at the offsets it wrote itself with the same tensor
shape gets each peer's element at the same place. None of this runs under the interpreter: kernels keep
another path for it.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# The region's address: global_smem is Triton's dynamic shared memory and the exchange its last bytes; $1
# counts back from the end (offset - the region's size: negative, the 32-bit wrap-around is intended).
_REGION = "mov.u32 a, global_smem; mov.u32 s, %dynamic_smem_size; add.u32 a, a, s; add.u32 a, a, $1; "
_STORE = tl.constexpr("{ .reg .u32 a, s; " + _REGION + "st.shared.f32 [a], $2; mov.u32 $0, 0; }")
_LOAD = tl.constexpr(
    "{ .reg .u32 a, s, r; " + _REGION + "mapa.shared::cluster.u32 r, a, $2; ld.shared::cluster.f32 $0, [r]; }"
)
# Arrive (release: this thread's shared-memory stores and peer loads before it), then wait for the whole
# cluster (acquire).
_SYNC = tl.constexpr(
    "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, $1;"
)


@triton.jit
def exchange_store(back, value):
    """Store fp32 `value` at exchange offset `back` (bytes, minus the region's size) of this program."""
    return tl.inline_asm_elementwise(_STORE, "=r,r,f", [back, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def exchange_load(back, rank):
    """fp32 at exchange offset `back` of the cluster's program `rank` (this program's own when it is its rank)."""
    return tl.inline_asm_elementwise(_LOAD, "=f,r,r", [back, rank], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def cluster_sync(token):
    """Every thread of every program in the cluster arrives and waits for all; returns `token`, so that what
    depends on the result comes after the sync."""
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
