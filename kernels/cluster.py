"""Thread-block clusters for plain Triton kernels on Hopper: a launch that groups programs into clusters, and
the cluster barrier, so that the programs of a cluster can hand each other data through memory without an
atomic arrival counter.

Triton's own `num_ctas` makes one program span the CTAs of a cluster (its tensors split across them). Here
every program stays one CTA: the kernel is compiled as usual and launched with a cluster dimension along x,
so program_id(0) = cluster * size + rank, and a cluster's programs are resident together on one GPC.

A program's global stores before `cluster_sync` are visible to every program of its cluster after it: the
barrier's arrive has release and its wait acquire semantics at cluster scope (the PTX memory model), which
is what a counter's `atom.acq_rel.gpu` plus a last-arriver test gave before, without the round trip to L2
for the atomic or the serial tail of one program merging everything. Nothing here runs under the
interpreter: kernels keep another path for it.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

CLUSTER_SIZES = (1, 2, 4, 8, 16)  # 16 is non-portable; the H100 and H200 allow it

# Every thread arrives (release) and then waits for all threads of the cluster (acquire).
_SYNC = tl.constexpr(
    "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, $1;"
)


@triton.jit
def cluster_sync(token):
    """The cluster barrier; every thread of every program in the cluster must reach it. Returns `token` (an
    int32 scalar): loads whose addresses depend on the result cannot move above the barrier, and stores in
    program order before it stay there (the asm is an ordered side effect)."""
    return tl.inline_asm_elementwise(_SYNC, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


def launch_clusters(kernel: JITFunction, clusters: int, size: int, args: tuple, kwargs: dict) -> None:
    """kernel[(clusters * size,)](*args, **kwargs) with the programs grouped into clusters of `size` along x
    (at most 8, or 16 where the device allows non-portable clusters, as the H100 / H200 do). kwargs must name
    every parameter not in args (and may add launch options such as num_warps and launch_pdl)."""
    if size not in CLUSTER_SIZES:
        raise ValueError(f"size: expected a cluster of {CLUSTER_SIZES} programs, got {size}")
    compiled = kernel.warmup(*args, grid=(clusters * size,), **kwargs)
    values = list(args) + [kwargs[name] for name in kernel.arg_names[len(args) :]]
    num_warps, _, shared = compiled.packed_metadata
    stream = torch.cuda.current_stream(torch.cuda.current_device()).cuda_stream
    # Triton's launcher takes the cluster size in the metadata it is given and multiplies grid x by it.
    compiled.run(
        clusters, 1, 1, stream, compiled.function, (num_warps, size, shared), None, None, None, *values
    )
