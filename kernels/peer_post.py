"""Post a tensor into every peer's mailbox and raise its flag there: the sending half of the lane exchange.

Each rank of a lane-parallel model owns a mailbox (rows [slots, P, capacity] of values, flags [slots, P] int32)
that the other ranks can write: CUDA IPC opens it in their processes, across devices through peer access. Rank r
posts slot s by copying its tensor into row (s, r) of every mailbox, its own included, and then storing the
step's epoch into flag (s, r) there. One program a destination; its stores are ordered before the flag by a
barrier and a release store at system scope, so a reader that sees the flag (an acquire load) sees the data:
no host and no collective take part.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import pdl_kwargs


@triton.jit
def _peer_post_kernel(
    src_ptr,
    n,
    row_table,
    flag_table,
    row_offset,
    flag_offset,
    epoch_ptr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the next kernel is queued at once; its own wait holds it until this post is done
        gdc_wait()
        gdc_launch_dependents()
    peer = tl.program_id(0)
    # the destinations are other processes' (or devices') memory: their addresses come as integers
    dest = tl.load(row_table + peer).to(tl.pointer_type(src_ptr.dtype.element_ty)) + row_offset
    start = 0
    while start < n:  # (a while loop: the interpreter cannot range over a runtime bound)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dest + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        start += BLOCK
    tl.debug_barrier()  # every thread's stores before the flag
    flag = tl.load(flag_table + peer).to(tl.pointer_type(tl.int32)) + flag_offset
    tl.atomic_xchg(flag, tl.load(epoch_ptr), sem="release", scope="sys")


def peer_post(
    src: torch.Tensor,
    row_table: torch.Tensor,
    flag_table: torch.Tensor,
    row_offset: int,
    flag_offset: int,
    epoch: torch.Tensor,
    use_pdl: bool = False,
) -> None:
    """src: contiguous, n values; row_table / flag_table: [P] int64 addresses of every mailbox's rows and flags
    (element type src's / int32); row_offset, flag_offset: elements into them; epoch: [1] int32, the flag value;
    use_pdl: programmatic dependent launch (kernels/__init__.py)."""
    n = src.numel()
    _peer_post_kernel[(row_table.numel(),)](
        src,
        n,
        row_table,
        flag_table,
        row_offset,
        flag_offset,
        epoch,
        BLOCK=min(1024, triton.next_power_of_2(n)),
        USE_PDL=use_pdl,
        **pdl_kwargs(use_pdl),
    )
