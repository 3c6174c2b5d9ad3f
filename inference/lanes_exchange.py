"""How the ranks of a lane-parallel model (inference/lanes_parallel.py) hand each other their partial sums.

Two transports with one interface, chosen per run:
- `CollectiveExchange`: torch.distributed's all-reduce and all-gather (gloo on the CPU, NCCL with one GPU a
  process); an asynchronous all-reduce is started when a partial exists and waited on where it is read.
- `PeerExchange`: every rank owns mailboxes in its GPU memory that the others write through CUDA IPC (peer
  access across GPUs; within one GPU, processes sharing it). A post copies a tensor into every mailbox and
  raises a flag holding the step's epoch (kernels/peer_post.py); a read waits on the device for the flags
  (kernels/peer_wait.py) and sums the rows in rank order. Nothing goes through the host or a collective per
  block, and NCCL's refusal of two ranks on one device does not apply.

A mailbox slot is written once a step, and every step ends with an exchange that all ranks wait on (the head's
lane mean): a rank can only post step s+1 into a slot once its owner has read step s's, so no slot needs two
buffers.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from inference import cuda_ipc


@dataclass(frozen=True)
class MailboxSpec:
    """A mailbox: `slots` exchanges a step, each up to `shape` values of `dtype` from every rank."""

    slots: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class CollectiveExchange:
    """torch.distributed collectives over the default process group."""

    def __init__(self, world: int):
        self.world = world

    def begin_step(self) -> None:
        pass

    def reduce(self, box: str, slot: int, total: torch.Tensor, at_once: bool) -> Callable[[], torch.Tensor]:
        """Start summing `total` over the ranks; returns what waits for the sum (the same on every rank)."""
        handle = dist.all_reduce(total, async_op=not at_once)
        if handle is None:
            return lambda: total

        def wait() -> torch.Tensor:
            handle.wait()
            return total

        return wait

    def gather(self, box: str, slot: int, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (all the same shape), stacked by rank: [P, *tensor.shape]."""
        gathered = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(gathered, tensor)
        return torch.stack(gathered)

    def check(self) -> None:
        pass


def shared(tensor: torch.Tensor) -> bytes:
    """What opens `tensor` in another process of this machine, pickled by torch.multiprocessing: a CUDA IPC
    handle for GPU memory; a shared-memory file for CPU memory (the CPU path: Triton's interpreter runs the
    kernels over it). The sender must outlive the receivers' use."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers its reductions with ForkingPickler

    return bytes(ForkingPickler.dumps(tensor))


class _Mailbox:
    """This rank's rows [slots, P, *shape] and flags [slots, P] int32, and every rank's addresses of both."""

    def __init__(self, spec: MailboxSpec, rank: int, world: int, device: torch.device):
        self.spec, self.rank, self.world = spec, rank, world
        self.rows = torch.zeros(spec.slots, world, *spec.shape, dtype=spec.dtype, device=device)
        self.flags = torch.zeros(spec.slots, world, dtype=torch.int32, device=device)
        if device.type == "cpu":  # moved to shared memory before any address is taken
            self.rows.share_memory_()
            self.flags.share_memory_()
        self.row_size = self.rows[0, 0].numel()
        handles = [None] * world
        if device.type == "cuda":  # opened on this device, so that its kernels can write another GPU's memory
            dist.all_gather_object(handles, (cuda_ipc.export(self.rows), cuda_ipc.export(self.flags)))
            addresses = [
                (self.rows.data_ptr(), self.flags.data_ptr())
                if r == rank
                else (cuda_ipc.open_address(rows, device), cuda_ipc.open_address(flags, device))
                for r, (rows, flags) in enumerate(handles)
            ]
        else:
            dist.all_gather_object(handles, (shared(self.rows), shared(self.flags)))
            # the other ranks' buffers, opened here (kept: closing them would unmap what the kernels write)
            self.peers = [
                (self.rows, self.flags) if r == rank else (pickle.loads(rows), pickle.loads(flags))
                for r, (rows, flags) in enumerate(handles)
            ]
            addresses = [(rows.data_ptr(), flags.data_ptr()) for rows, flags in self.peers]
        self.row_table = torch.tensor([rows for rows, _ in addresses], dtype=torch.int64, device=device)
        self.flag_table = torch.tensor([flags for _, flags in addresses], dtype=torch.int64, device=device)


class PeerExchange:
    """Mailboxes in GPU memory written by the other ranks directly (see the module's docstring). Built by every
    rank at once (it exchanges IPC handles over the default group, gloo); `mailboxes` names each one's spec."""

    def __init__(self, rank: int, world: int, device: torch.device, mailboxes: dict[str, MailboxSpec]):
        from kernels.peer_post import peer_post
        from kernels.peer_wait import peer_wait

        self._post, self._wait = peer_post, peer_wait
        self.rank, self.world, self.device = rank, world, device
        self.boxes = {name: _Mailbox(spec, rank, world, device) for name, spec in sorted(mailboxes.items())}
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)  # the flag value of the current step
        self.status = torch.zeros(1, dtype=torch.int32, device=device)  # 1: a wait gave up
        dist.barrier()  # every rank has opened every mailbox before anyone posts

    def begin_step(self) -> None:
        self.epoch += 1  # on the device: a captured step replays it

    def _post_and_wait(self, box: str, slot: int, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        mailbox = self.boxes[box]
        if tensor.numel() > mailbox.row_size or tensor.dtype != mailbox.spec.dtype:
            raise ValueError(
                f"mailbox {box}: {tuple(tensor.shape)} {tensor.dtype} does not fit {mailbox.spec}"
            )
        P = self.world
        self._post(tensor.contiguous().view(-1), mailbox.row_table, mailbox.flag_table,
                   (slot * P + self.rank) * mailbox.row_size, slot * P + self.rank, self.epoch)  # fmt: skip

        def wait() -> torch.Tensor:  # [P, *tensor.shape], every rank's post
            self._wait(mailbox.flags[slot], self.epoch, self.status)
            return mailbox.rows[slot].view(P, -1)[:, : tensor.numel()].view(P, *tensor.shape)

        return wait

    def reduce(self, box: str, slot: int, total: torch.Tensor, at_once: bool) -> Callable[[], torch.Tensor]:
        wait = self._post_and_wait(box, slot, total)
        if at_once:
            summed = wait().sum(0)
            return lambda: summed
        return lambda: wait().sum(0)

    def gather(self, box: str, slot: int, tensor: torch.Tensor) -> torch.Tensor:
        return self._post_and_wait(box, slot, tensor)().clone()

    def check(self) -> None:
        """Raise if a wait gave up (reads a device value: once a step, where the host waits anyway)."""
        if self.status.item():
            raise RuntimeError("lane exchange: a peer did not post within the wait's bound (a rank is gone?)")
