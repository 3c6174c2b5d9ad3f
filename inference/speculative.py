"""Exact speculative decoding with drafts copied from the context (prompt lookup), for any runner.

A draft is up to k tokens that followed an earlier occurrence of the context's longest repeated suffix
(code edits copy long spans of their prompt). The runner then runs one step over k+1 positions (the last
token and the draft) and walks the positions in order with its ordinary sampler:

    position j's token t_j = sample(logits_j, history so far)
    t_j == draft[j]: accepted, go on to position j+1; else t_j is emitted and the step ends.

That is the speculative-sampling rule for a deterministic draft (q is one-hot on draft[j]): the draft is
accepted with probability min(1, p/q) = p(draft[j]), and a rejection leaves t_j distributed as p with
draft[j] removed and renormalised, the residual norm(max(0, p - q)). Each emitted token costs the sampler
one uniform (sampling.Sampler.draw), exactly as in plain decoding, so a seed gives the same tokens with or
without speculation, and greedy decoding gives the same tokens by construction.

The draft length adapts (DraftLength): it doubles after a fully accepted draft, shrinks to what was
accepted after a partial one, and after a draft that was wholly rejected, or that emitted fewer tokens than
plain steps would have in the same time (StepClock), drafting pauses for a growing number of steps, so a
prompt with nothing to copy runs plain one-token steps.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.env import EnvError, env_number

# Suffixes longer than this are not looked for: a match of 8 tokens already predicts a copy well.
MAX_NGRAM = 8
# Wholly rejected drafts pause drafting for 1, 2, 4 ... up to this many steps.
MAX_PAUSE = 32


@dataclass(frozen=True)
class SpeculationSettings:
    enabled: bool = True
    max_draft: int = 8  # k at most: the positions a verify step adds to the one plain decoding runs

    @classmethod
    def from_env(cls) -> SpeculationSettings:
        """KOG_SPECULATIVE (1 | 0, default 1) and KOG_DRAFT_MAX (1..32, default 8)."""
        raw = os.environ.get("KOG_SPECULATIVE", "").strip().lower()
        if raw not in ("", "1", "0", "true", "false", "on", "off"):
            raise EnvError(f"KOG_SPECULATIVE: must be 1 or 0, got {raw!r}")
        max_draft = int(
            env_number("KOG_DRAFT_MAX", cls.max_draft, "an integer in [1, 32]", True, 1, maximum=32)
        )
        return cls(enabled=raw not in ("0", "false", "off"), max_draft=max_draft)


def speculation_asked() -> bool:
    """Whether KOG_SPECULATIVE is set (either way), rather than left to the runner's default."""
    return os.environ.get("KOG_SPECULATIVE", "").strip() != ""


class SuffixDrafter:
    """Proposes the tokens that followed the most recent earlier occurrence of the context's longest suffix
    that occurred before (1 to MAX_NGRAM tokens). The index maps each n-gram to where its latest occurrence
    ends, over every end but the context's own, so a lookup never finds the suffix itself.

    A prediction (OpenAI's Predicted Outputs: text the reply is expected to repeat, an edited file's old version)
    is searched first at each length: the tokens after its first occurrence of the suffix at or past where the
    reply would be had it followed the prediction since the last draft from it (else its latest), so that drafts
    walk through it in order, past repeated lines, as the reply follows it."""

    def __init__(self, tokens: list[int], prediction: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.prediction = list(prediction)
        # n-gram -> every end of it in the prediction with a token after it, ascending
        self.predicted_ends: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(self.prediction)):
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self.predicted_ends.setdefault(tuple(self.prediction[end - n : end]), []).append(end)
        self.from_prediction = False  # whether the last draft came from the prediction
        self.extend(tokens)
        # (where in the prediction the last draft from it began, the context's length then)
        self.prediction_mark = (0, len(self.tokens))

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._index_end(len(self.tokens))  # the old last position is no longer the context's end
            self.tokens.append(token)

    def _index_end(self, end: int) -> None:
        ctx = self.tokens
        for n in range(1, min(MAX_NGRAM, end) + 1):
            self.ends[tuple(ctx[end - n : end])] = end

    def draft(self, k: int) -> list[int]:
        ctx, size = self.tokens, len(self.tokens)
        self.from_prediction = False
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, size), 0, -1):
            suffix = tuple(ctx[size - n :])
            predicted = self.predicted_ends.get(suffix)
            if predicted:
                began, length = self.prediction_mark
                i = bisect_left(predicted, began + size - length)
                end = predicted[min(i, len(predicted) - 1)]
                self.prediction_mark, self.from_prediction = (end, size), True
                return self.prediction[end : end + k]
            end = self.ends.get(suffix)
            if end is not None:
                return ctx[end : end + k]
        return []


class DraftLength:
    """k for the next step from the acceptance seen so far in this generation, and from what a verify step
    costs: a step over k+1 positions takes `cost` times a plain step's time (the runner measures both), so it
    paid off when it emitted at least `cost` tokens (accepted + 1)."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.k = min(4, max_draft)
        self.pause = 0  # steps left without drafting
        self.next_pause = 1

    def next(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int, cost: float = 1.0) -> None:
        if drafted == 0:
            return
        if accepted + 1 < cost or accepted == 0:  # slower than plain steps: draft less, and less often
            self.k = max(1, min(self.k, accepted))
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
        elif accepted == drafted:
            self.k = min(2 * self.k, self.max_draft)
            self.next_pause = 1
        else:
            self.k = max(1, accepted)
            self.next_pause = 1


class StepClock:
    """The mean time of recent plain (one-position) steps, to price a verify step against."""

    def __init__(self):
        self.plain_s: float | None = None

    def plain(self, seconds: float) -> None:
        self.plain_s = seconds if self.plain_s is None else 0.8 * self.plain_s + 0.2 * seconds

    def cost(self, verify_seconds: float) -> float:
        """A verify step's time in plain steps (1 until a plain step was timed)."""
        return verify_seconds / self.plain_s if self.plain_s else 1.0


def accept(
    draft: list[int], sample_at: Callable[[int], int], stop_ids: frozenset[int] = frozenset()
) -> list[int]:
    """The tokens one verify step emits: the accepted prefix of `draft`, then the first token the model chose
    differently (or, all accepted, the token after the draft). `sample_at(j)` samples position j's token;
    it is called in order and only for the positions that are emitted (each call draws its own uniform).
    A stop id ends the step too: nothing after it is emitted."""
    emitted: list[int] = []
    for j in range(len(draft) + 1):
        token = sample_at(j)
        emitted.append(token)
        if j == len(draft) or token != draft[j] or token in stop_ids:
            break
    return emitted


@dataclass
class SpeculationCounts:
    """One generation's speculation so far: what the API's timings and the page's counters show."""

    decode_steps: int = 0  # model steps after the prefill (plain and verify alike)
    draft_n: int = 0  # draft tokens proposed
    draft_n_accepted: int = 0  # of which the model accepted
    prediction_draft_n: int = 0  # of the drafts, those taken from the request's prediction
    prediction_draft_n_accepted: int = 0  # of which the model accepted

    def add(self, drafter: SuffixDrafter, drafted: int, accepted: int) -> None:
        """A verify step's draft of `drafted` tokens, `accepted` of them kept (the drafter's last draft)."""
        self.draft_n += drafted
        self.draft_n_accepted += accepted
        if drafter.from_prediction:
            self.prediction_draft_n += drafted
            self.prediction_draft_n_accepted += accepted
