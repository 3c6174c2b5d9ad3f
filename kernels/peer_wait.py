"""Wait on the device until every rank has posted a mailbox slot: the receiving half of the lane exchange.

One program spins on the slot's P flags (acquire loads at system scope) until each holds the current epoch, so
the kernels queued after it read the posted rows; the host is not involved. A wait that outlasts `max_spins`
rounds gives up and records it in `status`, which the host reads once a step: a lost peer becomes an error,
not a hang.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import pdl_kwargs


@triton.jit
def wait_for_flags(flags_ptr, epoch_ptr, status_ptr, max_spins, P: tl.constexpr, P_POW2: tl.constexpr):
    """Spin (acquire loads at system scope) until flags [P] all hold the epoch, or give up after max_spins rounds
    and set status. A wait that gave up before marks the exchange broken: the step's later waits return at once,
    so a lost peer costs one bound, not one per wait until the host reads the status."""
    offs = tl.arange(0, P_POW2)
    mask = offs < P
    epoch = tl.load(epoch_ptr)
    seen = tl.atomic_add(flags_ptr + offs, 0, mask=mask, sem="acquire", scope="sys")
    missing = tl.sum(tl.where(mask & (seen != epoch), 1, 0), 0)
    spins = tl.where(tl.load(status_ptr) != 0, max_spins, 0)
    while (missing > 0) & (spins < max_spins):
        seen = tl.atomic_add(flags_ptr + offs, 0, mask=mask, sem="acquire", scope="sys")
        missing = tl.sum(tl.where(mask & (seen != epoch), 1, 0), 0)
        spins += 1
    if missing > 0:
        tl.store(status_ptr, 1)


@triton.jit
def _peer_wait_kernel(
    flags_ptr, epoch_ptr, status_ptr, max_spins, P: tl.constexpr, P_POW2: tl.constexpr, USE_PDL: tl.constexpr
):
    if USE_PDL:  # the next kernel loads its first weights while this one spins; its wait holds the rest
        gdc_wait()
        gdc_launch_dependents()
    wait_for_flags(flags_ptr, epoch_ptr, status_ptr, max_spins, P, P_POW2)


def peer_wait(
    flags: torch.Tensor,
    epoch: torch.Tensor,
    status: torch.Tensor,
    max_spins: int = 1 << 24,
    use_pdl: bool = False,
) -> None:
    """flags: [P] int32, one slot's flags in this rank's mailbox; epoch: [1] int32; status: [1] int32, set to 1
    when the wait gave up (after ~2^24 rounds of a microsecond or so: a rank that stopped, not a slow one); while
    it is set, waits do not spin."""
    P = flags.numel()
    _peer_wait_kernel[(1,)](
        flags,
        epoch,
        status,
        max_spins,
        P=P,
        P_POW2=triton.next_power_of_2(P),
        USE_PDL=use_pdl,
        **pdl_kwargs(use_pdl),
    )
