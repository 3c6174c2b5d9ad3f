"""Speculative decoding on the fast runner (inference/speculative.py's drafter and accept rule): FastRunner's
verify step and the decode loop that drafts, verifies and hands over to the plain graph steps.

A verify step runs the current token and k drafted ones as k+1 positions of the prefill's path
(forward_prompt from start = the token's position): each matrix product reads its weights once for all
rows, the attention is the prefill's causal one over the cache, windows included. It writes the keys and
values of all k+1 positions; nothing is rolled back, because nothing reads a row past the accepted ones
before it is written again: a decode step at position p writes row p before it attends to rows <= p (its
window's start only moves the lower bound), a later verify from p writes rows p .. p + k before attending,
and the next layer's L2 prefetch is a hint that reads no values. The Laneformer's delayed reductions carry
lane partials across layers of one position only (forward_prompt keeps them per row, the decode step
rewrites history[.., i - d] before reading it), so no state of a rejected position survives the step.
The hand-over to the decode graphs is then prefill's: the next input token, its position, out_tokens and
the seen ids; every other buffer a step reads it writes first. A greedy step does it on the device, with the
choice of the drafts kept (verify_greedy: one wait for the host a step); a sampled one from the host.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace

import torch

from inference.fast.head_choice import ScreenWatch
from inference.fast.verify_graphs import VerifyGraphs
from inference.speculative import (
    DraftLength,
    SpeculationCounts,
    SpeculationSettings,
    StepClock,
    SuffixDrafter,
    accept,
    speculation_asked,
)

LOOKAHEAD = 8  # decode steps queued on the GPU ahead of the token handed to the caller
RING = 16  # pinned slots for finished token ids (> LOOKAHEAD)
MAX_DRAFT = 32  # draft tokens a verify step takes at most (KOG_DRAFT_MAX's bound)
# Below this much weight a GPU decode step is so short that a verify step's launches cost several of them, more
# than drafts save: such models decode plainly unless KOG_SPECULATIVE=1 asks (docs/speculative-decoding.md).
GPU_SPECULATION_MIN_BYTES = 512 << 20


class SpeculativeSteps:
    """FastRunner's speculative part (a mixin: it reads the runner's buffers, graphs and settings)."""

    def _init_speculation(self, speculation: SpeculationSettings | None) -> None:
        if speculation is None:
            speculation = SpeculationSettings.from_env()
            if self.device.type == "cuda" and speculation.enabled and not speculation_asked():
                weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
                speculation = replace(speculation, enabled=weights >= GPU_SPECULATION_MIN_BYTES)
        self.speculation = speculation
        self.counts: SpeculationCounts | None = None  # the current generation's (None: speculation off)
        # the settings may change between requests (the benchmark's plain and drafted runs): room for the most
        rows = MAX_DRAFT + 1
        # A verify step's staged position and ids, its graphs by bucket of rows; the tokens it chose [k+1].
        self.verify_graphs = VerifyGraphs(self, rows)
        self.verify_tokens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        # Timed events at the end of each queued plain step (GPU), to price a verify step against.
        self.step_timers = (
            [torch.cuda.Event(enable_timing=True) for _ in range(RING)]
            if self.device.type == "cuda"
            else None
        )

    def _staged_graph(self, pos: int, draft: list[int], greedy: bool) -> torch.cuda.CUDAGraph | None:
        """The draft checked and staged for a step from pos; the graph that runs it (None: it runs eagerly)."""
        k = len(draft)
        if not 0 < k <= MAX_DRAFT:
            raise ValueError(f"draft: 1 to {MAX_DRAFT} tokens, got {k}")
        if pos + k >= self.max_context:
            raise ValueError(f"draft: positions up to {pos + k} past the context ({self.max_context})")
        self.verify_graphs.stage(pos, draft)
        return self.verify_graphs.graph_for(k + 1, pos, greedy)

    @torch.no_grad()
    def verify(self, pos: int, draft: list[int]) -> torch.Tensor:
        """The logits [k+1, V] fp32 of one step over the token at `pos` (self.token, not yet in the cache) and the
        k = len(draft) tokens after it: row j is what follows position pos + j. Writes the cache rows
        pos .. pos + k; leaves token, pos and everything else as they were."""
        rows, graph = len(draft) + 1, self._staged_graph(pos, draft, greedy=False)
        if graph is None:
            return self.verify_graphs.forward(rows).float()
        graph.replay()
        return self.verify_graphs.logits[:rows]

    @torch.no_grad()
    def verify_greedy(self, pos: int, draft: list[int]) -> list[int]:
        """A greedy verify step from `pos` that decides on the device (kernels/accept_draft.py): the tokens it
        emits, i.e. the drafts the model kept and then its own argmax after them. Writes the cache rows
        pos .. pos + k and leaves token, pos, out_tokens and seen as plain steps emitting those tokens would."""
        graph = self._staged_graph(pos, draft, greedy=True)
        if graph is None:
            self.verify_graphs.accept(len(draft) + 1)
        else:
            graph.replay()
        return self.verify_graphs.read_accepted()

    @torch.no_grad()
    def _verified_tokens(self, pos: int, draft: list[int]) -> list[int]:
        """The model's sampled token after each of the k+1 positions of a verify step, as plain steps would draw
        them from the same history: kernels/sample.py at each position in turn (its noise is keyed by the seed
        and the position, so position j draws what a plain step at pos + j would), every token joining the seen
        ids the next position is penalised by. Tokens past the first rejected draft are drawn too and then
        dropped (_take_verified clears their seen flags)."""
        logits = self.verify(pos, draft)
        for j in range(len(draft) + 1):
            self.logits.copy_(logits[j])
            self._sample_next()  # reads pos (pos + j), writes token, out_tokens[pos + j + 1], seen; pos += 1
            self.verify_tokens[j : j + 1].copy_(self.token)
        return self.verify_tokens[: len(draft) + 1].tolist()

    def _take_verified(self, pos: int, emitted: list[int], chosen: list[int], context: set[int]) -> None:
        """The decode state after a verify step from `pos` that emitted `emitted` (at pos + 1 ...): the last
        emitted token is the next step's input, at pos + len(emitted), as if each had been decoded in turn.
        chosen: the step's tokens; those past the emitted ones leave the seen ids unless in `context` (the
        prompt and the tokens generated so far, the emitted included)."""
        n = len(emitted)
        on_device = torch.tensor(emitted, dtype=torch.int32).to(self.device, non_blocking=True)
        self.token.copy_(on_device[-1:])
        self.pos.fill_(pos + n)
        self.out_tokens[pos + 1 : pos + 1 + n].copy_(on_device)
        self.seen.index_fill_(0, on_device.long(), True)
        dropped = [t for t in chosen[n:] if t not in context]
        if dropped:
            self.seen.index_fill_(0, torch.tensor(dropped, device=self.device), False)

    def _speculative_decode(self, prompt_ids: list[int], first: int, budget: int, greedy: bool, screen: bool,
                            watch: ScreenWatch | None, stop_ids: frozenset[int],
                            prediction: tuple[int, ...] = ()) -> Iterator[int]:  # fmt: skip
        """generate_tokens after its first token, with drafts (inference/runner.py's rule, step for step): a verify
        step when the context's suffix has a draft, else plain steps. Plain steps are the graph replays of plain
        decoding, LOOKAHEAD of them queued on a GPU; a draft found while steps are queued stops the queueing, and
        the verify step runs once the queue has drained (its draft is then taken at the context's end)."""
        counts = self.counts = SpeculationCounts()
        drafter, context = SuffixDrafter([*prompt_ids, first], prediction), {*prompt_ids, first}
        length, clock = DraftLength(self.speculation.max_draft), StepClock()
        on_gpu = self.device.type == "cuda"
        depth = LOOKAHEAD if on_gpu else 1
        graph = self.capture(greedy, screen=screen) if on_gpu else None
        front, made = len(prompt_ids), 1  # the position of the newest token on the device; tokens yielded
        pending: deque[tuple[int, bool]] = deque()  # (position, queued behind another step) of queued steps

        def next_draft() -> list[int]:
            k = min(length.next(), budget - made - 1 - len(pending))
            return drafter.draft(k) if k > 0 else []

        draft = next_draft()
        while made < budget:
            if draft and not pending:  # a verify step
                counts.decode_steps += 1
                began = time.perf_counter()
                # greedy: the step's emitted tokens, its state moved past them on the device; sampled: every row's
                # token (both wait for the device). A stop id among them still ends what is emitted.
                chosen = self.verify_greedy(front, draft) if greedy else self._verified_tokens(front, draft)
                emitted = accept(draft, chosen.__getitem__, stop_ids)
                context.update(emitted)
                if not greedy:
                    self._take_verified(front, emitted, chosen, context)
                last = len(emitted) - 1  # emitted[last] is the model's own choice, unless an accepted stop id
                accepted = last + int(last < len(draft) and emitted[last] == draft[last])
                counts.add(drafter, len(draft), accepted)
                length.update(len(draft), accepted, clock.cost(time.perf_counter() - began))
                front += len(emitted)
                for token in emitted:
                    yield token
                    made += 1
                    if token in stop_ids:
                        return
                drafter.extend(emitted)
                draft = next_draft()
                continue
            while not draft and made + len(pending) < budget and len(pending) < depth:
                front += 1
                pending.append((front, bool(pending)))
                if on_gpu:
                    graph.replay()  # leaves position front's token at ring slot front % RING
                    self.token_events[front % RING].record()
                    self.step_timers[front % RING].record()
                else:
                    began = time.perf_counter()
                    self.decode_step(greedy, screen)
                    clock.plain(time.perf_counter() - began)
            position, queued = pending.popleft()
            counts.decode_steps += 1
            if on_gpu:
                self.token_events[position % RING].synchronize()
                token = int(self.host_ring[position % RING])
                if queued:  # the GPU went from the step before straight to this one: its time is the step's
                    # the timer is recorded after the token's event: that one's completion does not imply this one's
                    self.step_timers[position % RING].synchronize()
                    clock.plain(
                        self.step_timers[(position - 1) % RING].elapsed_time(
                            self.step_timers[position % RING]
                        )
                        / 1e3
                    )
            else:
                token = int(self.token.item())
            if watch is not None and self._leaves_screen(watch, position):
                screen, watch = False, None
                graph = self.capture(greedy, screen=False) if on_gpu else None
            yield token
            made += 1
            if token in stop_ids:
                return
            drafter.extend([token])
            context.add(token)
            draft = next_draft()
