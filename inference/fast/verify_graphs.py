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
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from inference.fast.prefill import forward_prompt

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
        # [pos, ids...]: the step's first position, then its input ids (row 0, the current token, is copied from
        # runner.token on the device; rows 1 .. k are the drafts)
        self.staged = torch.zeros(max_rows + 1, dtype=torch.long, device=device)
        self.start, self.ids = self.staged[:1], self.staged[1:]
        self.host = torch.zeros(max_rows + 1, dtype=torch.long, pin_memory=self.on_gpu)
        self.copied = torch.cuda.Event() if self.on_gpu else None
        self.buckets = [b for b in VERIFY_BUCKETS if b <= max_rows and b < runner.max_context]
        # every row's logits [rows, V] fp32, written by a replay
        vocab = runner.cfg.vocab_size
        self.logits = torch.zeros(max(self.buckets, default=0), vocab, device=device) if self.on_gpu else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # one memory pool: the buckets never replay at once and keep nothing but `logits`

    @property
    def runner(self) -> FastRunner:
        return self._runner()

    def capture_up_to(self, rows: int) -> None:
        """The graphs a draft of up to rows - 1 tokens replays, captured now (not on a request's first step)."""
        if not self.on_gpu:
            return
        for bucket in reversed(self.buckets):  # the largest first: it sizes the shared pool
            if bucket < 2 * rows and bucket not in self.graphs:
                self._capture(bucket)

    def _capture(self, bucket: int) -> None:
        self.pool = self.pool if self.graphs else torch.cuda.graph_pool_handle()
        self.graphs[bucket] = self.runner._graph_of(
            lambda: self.logits[:bucket].copy_(self.forward(bucket)), pool=self.pool
        )

    def clear(self) -> None:
        self.graphs.clear()

    def stage(self, pos: int, draft: list[int]) -> None:
        """[pos, (token), draft...] onto the device in one asynchronous copy from the pinned buffer."""
        k = len(draft)
        if self.on_gpu:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.host.numpy()
        host[0] = pos
        host[2 : k + 2] = draft
        self.staged[1 : k + 2].copy_(self.host[1 : k + 2], non_blocking=self.on_gpu)
        self.staged[:1].copy_(self.host[:1], non_blocking=self.on_gpu)
        if self.on_gpu:
            self.copied.record()

    def graph_for(self, rows: int, pos: int) -> torch.cuda.CUDAGraph | None:
        """The graph of a step of `rows` positions from pos, or None where it runs eagerly."""
        bucket = next((b for b in self.buckets if b >= rows), None)
        if not self.on_gpu or bucket is None or pos + bucket > self.runner.max_context:
            return None
        if bucket not in self.graphs:
            self._capture(bucket)
        return self.graphs[bucket]

    def forward(self, rows: int) -> torch.Tensor:
        """The step's math (a bucket's graph copies it into `logits`; eagerly it is the result): the staged ids,
        the current token first, through forward_prompt from the staged position; every row's logits [rows, V]."""
        r = self.runner
        ids = self.ids[:rows]
        ids[:1].copy_(r.token)
        return forward_prompt(r.model, r.layers, r.cache, r.attn_scratch, ids, None, self.start)
