"""CUDA graphs of a suffix prefill: the part of a prompt after a reused prefix (inference/prefix_cache.py).

A follow-up's few dozen new tokens cost the prefill's launches, not its arithmetic (each layer's kernels and
cuBLAS calls queued from Python one after the other), so they replay a graph captured per bucket, as a cold
prompt up to 1024 tokens does. The graph reads everything that varies from the runner's staged prompt
(FastRunner._stage_prompt): its ids, the row of its last id and start, the reused prefix's length, which the
prefill kernels load from that device scalar at each replay (kernels/prefill_attention.py `start`).

A bucket's rows past the real suffix are ids left from earlier prompts: they compute rows nothing reads and
write the cache rows start + T .. start + bucket - 1, which later steps overwrite (causal attention never lets
a real row see them). Hence a graph only where start + bucket fits the cache; past that the prefill is eager.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inference.fast.runner import FastRunner

# suffix lengths a graph is captured for (each suffix replays the smallest bucket that holds it)
SUFFIX_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


class SuffixGraphs:
    """The runner's suffix prefill graphs by bucket; none on the CPU (there the suffix prefill is eager)."""

    def __init__(self, runner: FastRunner) -> None:
        # weak: a runner <-> graphs cycle would leave a dropped runner to the cyclic collector, which can run in
        # the middle of another runner's capture and free pinned buffers there (an event query: capture broken)
        self._runner = weakref.ref(runner)
        fitting = [b for b in SUFFIX_BUCKETS if b < runner.max_context]
        self.buckets = fitting if runner.device.type == "cuda" else []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle)
        # rows 0 .. bucket - 1 of the suffix; + start: their positions in the staged prompt [bucket] int64
        # (forward runs eagerly on the CPU too, where the tests check its math)
        self.rows = torch.arange(max(fitting, default=0), device=runner.device)

    @property
    def runner(self) -> FastRunner:
        return self._runner()

    def capture_all(self) -> None:
        for bucket in reversed(self.buckets):  # the largest first: it sizes the pool the others share
            self._capture(bucket)

    def _capture(self, bucket: int) -> None:
        # One memory pool for all: a replay leaves nothing behind but the logits (copied into runner.logits) and
        # the cache rows, so the buckets' temporaries can share memory as the prefill of one request at a time.
        self.pool = self.pool if self.graphs else torch.cuda.graph_pool_handle()
        self.graphs[bucket] = self.runner._graph_of(lambda: self.forward(bucket), pool=self.pool)

    def clear(self) -> None:
        self.graphs.clear()

    def for_suffix(self, length: int, start: int) -> torch.cuda.CUDAGraph | None:
        """The graph that prefills `length` ids from position start, or None where the prefill stays eager (no
        bucket holds them, or the bucket's rows would run past the cache)."""
        bucket = next((b for b in self.buckets if b >= length), None)
        if bucket is None or start + bucket > self.runner.max_context:
            return None
        if bucket not in self.graphs:
            self._capture(bucket)
        return self.graphs[bucket]

    def forward(self, bucket: int) -> None:
        """What a bucket's graph runs (also callable eagerly): the staged prompt's ids from position start
        (`bucket` of them) through forward_prompt at that start, the logits at the last prompt id's row."""
        r = self.runner
        ids = r.prompt_ids.index_select(0, r.prompt_start + self.rows[:bucket])  # [bucket]
        r.logits.copy_(r.forward_prompt(ids, r.prompt_last - r.prompt_start, r.prompt_start))
