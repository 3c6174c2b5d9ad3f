"""Ordering between the kernels of one decode step through counters in memory instead of whole-grid waits.

With programmatic dependent launch (PDL) a kernel may start while the one before it still runs; the usual
`griddepcontrol.wait` then blocks until that whole grid has exited and its memory is flushed, which costs
~2-2.5 us at every one of the 80-140 kernel boundaries of a step (kernels/NOTES.md). Here instead:

    producer program:  stores ... ; barrier ; atomic_add(flags[signal], 1)      (release, GPU scope)
    consumer program:  trigger dependents ; weight tiles in flight ;
                       spin until flags[wait] == producer programs ; acquire ; read activations from L2

Every kernel triggers its dependents first thing, so the next kernel launches as soon as every program of
this one has started, holds its first weights in registers while it spins, and goes on the moment the last
producer program's stores are visible. Activations are read with `.cg` (L2, the point of coherence): an SM's
L1 may hold an older copy of a buffer a still-running kernel rewrites.

Progress: the PDL trigger fires only once every program of a kernel has started, so the programs of kernel
N + 1 never occupy a multiprocessor that a program of kernel N is still waiting for; by induction from the
step's first kernel (which waits on nothing) every spin ends.

Counters start at zero. The step's last kernel (the head) zeroes them once every program of the step has
passed its wait: the step can then be replayed as a CUDA graph with the same targets every time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import interpreted

# The interpreter runs programs one after another, in launch order: there a counter is complete when read.
_INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def _load_relaxed(ptr):
    """flags[i] from L2 (relaxed, GPU scope). Not an acquire load: on this GPU each acquire also invalidates
    the multiprocessor's L1, which a spin loop would do thousands of times under the working programs."""
    if _INTERPRETED:
        return tl.load(ptr, volatile=True)
    else:
        return tl.inline_asm_elementwise(
            "ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _pause(token):
    """A short sleep between polls, so that spinning programs leave L2 and the issue slots to working ones."""
    if not _INTERPRETED:
        tl.inline_asm_elementwise(
            "nanosleep.u32 32; mov.u32 $0, 0;", "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _load_acquire(ptr):
    """flags[i] read once more with acquire semantics: this thread's later loads are ordered after it. (A
    fence.acq_rel here would also wait for the weight tiles already in flight before x could be requested.)"""
    if _INTERPRETED:
        return tl.load(ptr, volatile=True)
    else:
        return tl.inline_asm_elementwise(
            "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def wait_for(flags_ptr, index, target):
    """Spin until flags[index] >= target (no wait when target is 0); what its producers wrote is then visible."""
    if target > 0:
        seen = _load_relaxed(flags_ptr + index)
        while seen < target:
            _pause(seen)
            seen = _load_relaxed(flags_ptr + index)
        # the counter only grows: the acquire load reads >= target too, and synchronises with every release
        _load_acquire(flags_ptr + index)


@triton.jit
def signal_done(flags_ptr, index):
    """This program's stores are done: publish them (every thread's stores precede the release)."""
    tl.debug_barrier()
    tl.atomic_add(flags_ptr + index, 1, sem="release", scope="gpu")


@dataclass(frozen=True)
class Link:
    """What one launch needs: the counter it waits on (and the count meaning done), the one it increments."""

    flags: torch.Tensor
    wait_index: int
    wait_target: int
    signal_index: int


class StepChain:
    """The counters of one decode step, handed out in launch order: each kernel waits on the one before."""

    def __init__(self, capacity: int, device: torch.device, early_trigger: bool = False):
        self.flags = torch.zeros(capacity, dtype=torch.int32, device=device)
        # early_trigger: each kernel lets the next one launch first thing instead of after its own wait
        # (then several kernels ahead can be resident and spinning at once)
        self.early_trigger = early_trigger
        self.start()

    def start(self) -> None:
        """A new step: counters are handed out from the first again (the head left them at zero)."""
        self.used = 0
        self._last = (0, 0)  # (index, programs): the first kernel waits on nothing

    def link(self, signals: int) -> Link:
        """The next launch, whose `signals` programs will each increment its counter once."""
        if self.used >= self.flags.numel():
            raise ValueError(f"chain: more than {self.flags.numel()} kernels in one step")
        wait_index, wait_target = self._last
        index = self.used
        self.used += 1
        self._last = (index, signals)
        return Link(self.flags, wait_index, wait_target, index)

    def reset_block(self) -> int:
        """A power of two covering the counters in use (the head zeroes them in one vector store)."""
        return triton.next_power_of_2(max(self.used, 1))
