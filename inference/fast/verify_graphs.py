"""CUDA graphs of a speculative verify step: the current token and k drafts as k+1 positions of the prefill's
path (FastRunner.verify), one graph per bucket of rows.

Eagerly a verify step is bound by its launches (each layer's kernels and matrix products queued from Python),
which would cost more than the drafts save. A graph reads everything that varies on the device: the position
from a staged scalar (the prefill kernels take `start` as a pointer, as the suffix graphs do), the current token
from the runner's `token`, the drafts from the staged ids; it leaves every row's logits in `logits`.

A bucket's rows past k + 1 hold ids left from earlier drafts: they compute rows nothing reads and write cache
rows pos + k + 1 .. pos + bucket - 1, which later steps overwrite before reading (as a rejected draft's rows are).
Hence a graph only where pos + bucket fits the cache; past that, and for drafts over the largest bucket, the step
runs eagerly.

A greedy step has graphs of its own that also decide on the device (kernels/accept_draft.py): the argmax of each
row, the drafts kept, and the decode state after the tokens emitted, with those tokens left in pinned host memory.
The host then waits once a step and copies nothing back to the device; a sampled step keeps the logits graphs
(its sampler walks the rows in turn).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from inference.fast.prefill import forward_prompt
from kernels.accept_draft import accept_draft

if TYPE_CHECKING:
    from inference.fast.runner import FastRunner

# rows (k + 1) a graph is captured for; a step replays the smallest bucket that holds its rows
VERIFY_BUCKETS = (2, 4, 8, 16, 32)


class VerifyGraphs:
    """The runner's verify graphs and the device buffers they read; graphs only on a GPU."""

    def __init__(self, runner: FastRunner, max_rows: int) -> None:
        # weak: a runner <-> graphs cycle would leave a dropped runner to the cyclic collector (suffix_graphs.py)
        self._runner = weakref.ref(runner)
        device = runner.device
        self.on_gpu = device.type == "cuda"
        # [pos, k, ids...]: the step's first position, its draft's length, then its input ids (row 0, the current
        # token, is copied from runner.token on the device; rows 1 .. k are the drafts)
        self.staged = torch.zeros(max_rows + 2, dtype=torch.long, device=device)
        self.start, self.ids = self.staged[:1], self.staged[2:]
        self.host = torch.zeros(max_rows + 2, dtype=torch.long, pin_memory=self.on_gpu)
        self.copied = torch.cuda.Event() if self.on_gpu else None
        self.buckets = [b for b in VERIFY_BUCKETS if b <= max_rows and b < runner.max_context]
        # every row's logits [rows, V] fp32, written by a replay
        vocab = runner.cfg.vocab_size
        self.logits = torch.zeros(max(self.buckets, default=0), vocab, device=device) if self.on_gpu else None
        # a greedy step's [n kept, its emitted tokens...], written by the device (kernels/accept_draft.py)
        self.accepted = torch.zeros(max_rows + 1, dtype=torch.int32, pin_memory=self.on_gpu)
        self.accepted_ready = torch.cuda.Event() if self.on_gpu else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # one memory pool: the buckets never replay at once and keep nothing but `logits` and `accepted`
        self.pool = None

    @property
    def runner(self) -> FastRunner:
        return self._runner()

    def capture_up_to(self, rows: int) -> None:
        """The graphs a draft of up to rows - 1 tokens replays, captured now (not on a request's first step)."""
        if not self.on_gpu:
            return
        for bucket in reversed(self.buckets):  # the largest first: it sizes the shared pool
            if bucket < 2 * rows:
                for greedy in (True, False):
                    if bucket not in self._graphs(greedy):
                        self._capture(bucket, greedy)

    def _graphs(self, greedy: bool) -> dict[int, torch.cuda.CUDAGraph]:
        return self.greedy_graphs if greedy else self.graphs

    def _capture(self, bucket: int, greedy: bool) -> None:
        self.pool = self.pool if self.graphs or self.greedy_graphs else torch.cuda.graph_pool_handle()

        def run() -> None:
            if greedy:
                self.accept(bucket)
            else:
                self.logits[:bucket].copy_(self.forward(bucket))

        with self.runner.step_state_kept():  # the capture's eager run of a greedy step moves the state on
            self._graphs(greedy)[bucket] = self.runner._graph_of(run, pool=self.pool)

    def clear(self) -> None:
        self.graphs.clear()
        self.greedy_graphs.clear()

    def stage(self, pos: int, draft: list[int]) -> None:
        """[pos, k, (token), draft...] onto the device in one asynchronous copy from the pinned buffer (the token's
        slot is then written on the device)."""
        k = len(draft)
        if self.on_gpu:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.host.numpy()
        host[0], host[1] = pos, k
        host[3 : k + 3] = draft
        self.staged[: k + 3].copy_(self.host[: k + 3], non_blocking=self.on_gpu)
        if self.on_gpu:
            self.copied.record()

    def graph_for(self, rows: int, pos: int, greedy: bool = False) -> torch.cuda.CUDAGraph | None:
        """The graph of a step of `rows` positions from pos (greedy: the one that accepts on the device), or None
        where it runs eagerly."""
        bucket = next((b for b in self.buckets if b >= rows), None)
        if not self.on_gpu or bucket is None or pos + bucket > self.runner.max_context:
            return None
        graphs = self._graphs(greedy)
        if bucket not in graphs:
            self._capture(bucket, greedy)
        return graphs[bucket]

    def accept(self, rows: int) -> None:
        """A greedy step's math after `forward`: each row's argmax, then kernels/accept_draft.py (the runner's token,
        pos, out_tokens and seen moved on past the emitted tokens, which land in `accepted`)."""
        r = self.runner
        chosen = self.forward(rows)[:, : r.vocab_limit].argmax(-1)  # [rows] int64
        accept_draft(chosen, self.staged, token=r.token, pos=r.pos, out_tokens=r.out_tokens, seen=r.seen,
                     host=self.accepted)  # fmt: skip

    def read_accepted(self) -> list[int]:
        """The tokens the last greedy step emitted (the kept drafts, then the model's own), once it has finished."""
        if self.on_gpu:
            self.accepted_ready.record()
            self.accepted_ready.synchronize()
        n = int(self.accepted[0])
        return self.accepted[1 : n + 2].tolist()

    def forward(self, rows: int) -> torch.Tensor:
        """The step's math (a bucket's graph copies it into `logits`; eagerly it is the result): the staged ids,
        the current token first, through forward_prompt from the staged position; every row's logits [rows, V]."""
        r = self.runner
        ids = self.ids[:rows]
        ids[:1].copy_(r.token)
        return forward_prompt(r.model, r.layers, r.cache, r.attn_scratch, ids, None, self.start,
                              pdl=r.settings.pdl)  # fmt: skip
