"""Prefix reuse: a request starts from the longest cached prefix of its token ids and prefills only the rest.

A follow-up on the page, an agent's next turn or a retry re-sends a prompt whose beginning the worker computed
a moment ago. The runner's own KV cache (the live one, which its decode steps and CUDA graphs read in place)
still holds the last request's keys and values; a few slots hold copies of earlier ones, least recently used
out. For a new prompt the live cache keeps the longest prefix any of them shares with it: as it is when the
live one shares the most (rows past the match are simply overwritten), or copied in from the best slot, after
the live cache was itself saved into a slot when it holds something the new request would overwrite.

Exactness: position p's keys and values depend only on the tokens 0 .. p, so rows [0, n) computed for any
earlier sequence with the same first n ids are what a cold prefill writes there (up to the rounding of how
they were computed: one prefill, or several plus decode steps). Everything else a prefill leaves is per
position: the Laneformer's delayed reduction reads the partials of layer i - d at the *same* position, which the
suffix's prefill computes itself, so nothing but the cache rows carries over. The last prompt token is always
prefilled again: its logits give the first new token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference.config import env_prefix_slots
from inference.failures import is_memory_error
from inference.model import KVCache

log = logging.getLogger(__name__)

GPU_SHARE = 0.5  # of the memory free after the weights and the graphs: the rest stays for prefill activations
CPU_SHARE = 0.25  # of the host's available memory


def check_prompt_span(n: int, start: int, max_context: int) -> None:
    """ValueError unless a prompt of n ids fits the context and start (the ids already in the cache) leaves its
    last id to prefill, whose logits give the first token."""
    if not 0 < n < max_context:
        raise ValueError(f"prompt_ids: length must be in [1, {max_context - 1}], got {n}")
    if not 0 <= start < n:
        raise ValueError(
            f"start: must be in [0, {n - 1}] (the last prompt id is always prefilled), got {start}"
        )


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b share. Slices compare at C speed, so a whole match is one comparison and a
    mismatch is found by halving: a Python loop over a few thousand ids would slow every follow-up."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def spare_bytes(device: torch.device) -> int:
    """What the device can spare for saved caches: a share of what is free now (after the weights, the runner's
    buffers and its graphs on a GPU; the host's MemAvailable on the CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    return int(available * CPU_SHARE)


@dataclass
class Slot:
    ids: list[int]  # the tokens whose keys and values rows [0, len(ids)) hold
    k: torch.Tensor  # [N, 1, KV, max_len, hd], as the live cache's
    v: torch.Tensor


class PrefixCache:
    """The live cache's contents (`ids`) and up to `capacity` saved copies, most recently used last; `on`
    False: every request starts from position 0."""

    def __init__(self, live: KVCache, capacity: int, on: bool = True):
        self.live, self.capacity, self.on = live, capacity, on
        self.ids: list[int] = []  # rows [0, len(ids)) of the live cache hold these tokens' keys and values
        self.slots: list[Slot] = []  # allocated on first use, so an idle runner holds none
        self.copied_tokens = 0  # rows copied into slots and back: what reuse cost in copies

    @classmethod
    def sized(cls, live: KVCache, requested: int | None = None) -> PrefixCache:
        """As many slots as asked for (KOG_PREFIX_SLOTS) and the device can spare, one live-cache size each."""
        requested = env_prefix_slots() if requested is None else requested
        slot_bytes = 2 * live.k.numel() * live.k.element_size()
        fits = spare_bytes(live.k.device) // slot_bytes if requested else 0
        capacity = min(requested, fits)
        if not requested:
            log.info("prefix reuse: off (KOG_PREFIX_SLOTS=0); every prompt is prefilled from its start")
            return cls(live, 0, on=False)
        # with no room for a slot the live cache alone still serves the follow-up of the last request
        log.info(
            "prefix reuse: keeps %d KV caches of %.1f MiB besides the live one (KOG_PREFIX_SLOTS=%d, room for %d)",
            capacity, slot_bytes / 2**20, requested, fits,
        )  # fmt: skip
        return cls(live, capacity)

    def begin(self, prompt_ids: list[int]) -> int:
        """Make rows [0, n) of the live cache hold prompt_ids[:n] for the largest n available (at most all but
        the last id, whose logits the prefill must compute); returns n. The live cache then claims those rows
        only, until `written` says what the request put there."""
        if not self.on:
            return 0
        limit = len(prompt_ids) - 1
        shared = common_prefix(self.ids, prompt_ids)
        live_match = min(shared, limit)
        best = max(self.slots, key=lambda s: common_prefix(s.ids, prompt_ids), default=None)
        slot_match = min(common_prefix(best.ids, prompt_ids), limit) if best is not None else 0
        use_slot = slot_match > live_match
        start = slot_match if use_slot else live_match
        if shared < len(self.ids):  # the request overwrites rows the live cache holds: keep them if new
            self._save_live(keep=best if use_slot else None)
        if use_slot:
            self._copy(best.k, best.v, self.live.k, self.live.v, start)
            self.slots.remove(best)
            self.slots.append(best)  # most recently used
        self.ids = list(prompt_ids[:start])
        return start

    def written(self, ids: list[int]) -> None:
        """The live cache's rows [0, len(ids)) now hold `ids` (the prompt and every token fed back in)."""
        self.ids = list(ids)

    def _save_live(self, keep: Slot | None) -> None:
        """Copy the live cache into a slot (one it extends, else a new one while under capacity, else the least
        recently used one other than `keep`), unless a slot already holds all of it."""
        if any(common_prefix(s.ids, self.ids) == len(self.ids) for s in self.slots):
            return
        extended = [s for s in self.slots if s is not keep and common_prefix(s.ids, self.ids) == len(s.ids)]
        target = extended[0] if extended else None
        if target is None and len(self.slots) < self.capacity:
            try:
                target = Slot([], torch.empty_like(self.live.k), torch.empty_like(self.live.v))
            except Exception as exc:  # the memory counted at load was taken since: go on without this slot
                if not is_memory_error(exc):
                    raise
                log.warning("prefix reuse: no memory for another saved cache; keeping %d", len(self.slots))
                self.capacity = len(self.slots)
        if target is None:
            target = next((s for s in self.slots if s is not keep), None)
            if target is None:
                return
        if target in self.slots:
            self.slots.remove(target)
        self._copy(self.live.k, self.live.v, target.k, target.v, len(self.ids))
        target.ids = list(self.ids)
        self.slots.append(target)

    def _copy(self, k: torch.Tensor, v: torch.Tensor, k_to: torch.Tensor, v_to: torch.Tensor, n: int) -> None:
        # rows [0, n) of every layer: [N, B, KV, n, hd], keys and values
        k_to[:, :, :, :n].copy_(k[:, :, :, :n])
        v_to[:, :, :, :n].copy_(v[:, :, :, :n])
        self.copied_tokens += n
