"""The fast runner's settings: the defaults measured on an H200 (weight tiles before each kernel's wait, the
kinds that let the next kernel launch early, when the head screen is on), and the parsers that turn the KOG_*
environment variables and FastRunner's arguments into checked overrides (for sweeps: scripts/decode_variants.py).
FastRunner (inference/fast/runner.py) reads them once, when it is built."""

from __future__ import annotations

import os

# Weight tiles each matrix-vector kind loads before it waits on the previous kernel (kernels' `prefetch`;
# more than a row has means all). The o-proj takes all of its tiles: attention before it reads little, so
# its weights stream while attention runs (H200, scripts/decode_variants.py in turns on one machine: llama
# 1,184 -> 1,212 tok/s, laneformer 698 -> 709). More tiles for the others measured no better (qkv, gate/up)
# or far worse (laneformer's down-proj at 3 tiles: registers).
DEFAULT_PREFETCH = {"qkv": 1, "o": 64, "gate_up": 1, "down": 1}
# With lane groups the gate/up pair takes two tiles (laneformer-2b, three calls in turns: +0.4%, +0.4%, +0.6%).
GROUPED_PREFETCH = {"gate_up": 2}
# The norm-fused kinds whose blocks of rows a program may be told to take in turn (rmsnorm_gemv's
# `row_blocks`; unset: the kernel's own choice).
ROW_BLOCK_KINDS = ("qkv", "gate_up")


def kind_overrides(spec: str | dict[str, int], kinds, what: str = "prefetch", switches=()) -> dict[str, int]:
    """'o=4,gate_up=2' (an environment variable's form) or {'o': 4, 'gate_up': 2} -> the checked dict: every
    kind one of `kinds`, every value an integer >= 1 (0 or 1 for the kinds in `switches`)."""
    if isinstance(spec, str):
        items = [item.partition("=")[::2] for item in (part.strip() for part in spec.split(",")) if item]
    else:
        items = [
            (kind, str(int(value)) if isinstance(value, bool) else str(value)) for kind, value in spec.items()
        ]
    for kind, value in items:
        allowed = value in ("0", "1") if kind in switches else value.isdigit() and int(value) >= 1
        if kind not in kinds or not allowed:
            raise ValueError(f"{what}: expected kind=n with kind in {', '.join(kinds)} and n >= 1 "
                             f"(0 or 1 for {', '.join(switches) or 'none'}), got {kind}={value}")  # fmt: skip
    return {kind: int(value) for kind, value in items}


def env_then_argument(env_name: str, argument: dict[str, int] | None, kinds, what: str,
                      switches=()) -> dict[str, int]:  # fmt: skip
    """A runner setting's overrides: the environment variable's (kind_overrides' form; for sweeps), then the
    constructor argument's over them."""
    return {**kind_overrides(os.environ.get(env_name, ""), kinds, env_name, switches),
            **kind_overrides(argument or {}, kinds, what, switches)}  # fmt: skip


def env_number(
    env_name: str, default: float, what: str, low: float = float("-inf"), high: float = float("inf")
) -> float:
    """A number from the environment (unset: default), refused unless it is one in [low, high]."""
    setting = os.environ.get(env_name, "")
    try:
        value = float(setting) if setting else default
    except ValueError:
        raise ValueError(f"{env_name}: expected {what}, got {setting!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{env_name}: expected {what} in [{low:g}, {high:g}], got {setting!r}")
    return value


def prefetch_overrides(spec: str | dict[str, int]) -> dict[str, int]:
    """KOG_PREFETCH's form (or a dict): weight tiles before the wait by kind (DEFAULT_PREFETCH's kinds)."""
    return kind_overrides(spec, DEFAULT_PREFETCH)


BLOCK_KEYS = ("block_n", "block_k", "num_warps")
HEAD_KEYS = ("block_n", "row_blocks", "num_warps")  # lm_head's block arguments
ATTENTION_KEYS = (
    "splits", "block_t", "num_warps", "cluster", "push", "maxnreg", "prefetch_next", "kv_evict_first"
)  # fmt: skip
ATTENTION_SWITCHES = ("cluster", "push", "prefetch_next", "kv_evict_first")
SWITCH_ENV = (
    ("KOG_ATTN_CLUSTER", "cluster"), ("KOG_ATTN_PUSH", "push"), ("KOG_ATTN_PREFETCH_NEXT", "prefetch_next")
)  # fmt: skip
# Lane groups: how many (1: none). Unset: 2 on a GPU wherever the lanes split in two past their first layers
# (laneformer-2b on an H200, scripts/decode_variants.py in turns: 800 -> 844 tok/s; 4 groups 832).
LANE_GROUP_KEYS = ("groups",)
# Matrix-vector kinds that let the next kernel launch before their own wait (kernels' `trigger_early`).
EARLY_KINDS = ("qkv", "o", "gate_up", "down")
# One-lane models (Llama, Qwen3): the q|k|v and o-proj kernels trigger early, so the attention's programs are
# resident (and load their first key block) while q|k|v streams, and the gate/up programs while the attention and
# the o-proj run, each with 3 tiles of the pair in flight before its wait. H200, scripts/decode_variants.py in
# turns (kernels/NOTES.md round 11): llama-3.2-1b 1,402 -> 1,419 tok/s, qwen3-1.7b 942 -> 958; 2 or 4 tiles, or
# either trigger alone, gained less; an early down-proj lost 8% on qwen3. Laneformer's lane groups: no change.
ONE_LANE_EARLY = {"qkv": 1, "o": 1}
ONE_LANE_PREFETCH = {"gate_up": 3}
# The smallest head the screen is on for by default: below it the head's read is short beside the screen's two
# launches (H200, models/default's 8,192 x 384 head: 16,140 tok/s whole, 15,426 screened; laneformer-2b's 192 MiB
# +1%, llama-3.2-1b's 501 MiB +9%).
SCREEN_MIN_HEAD_BYTES = 32 << 20
# The highest temperature whose sampled steps read the head through its screen (uses_screen).
SAMPLED_SCREEN_TEMPERATURE = 0.3


def block_spec(spec: str | dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """KOG_BLOCKS's form, 'down=2/1024/8,o=4/512/4' (block_n/block_k/num_warps; 0 keeps the kernel's choice), or
    the dict it stands for, {'down': {'block_n': 2, 'block_k': 1024, 'num_warps': 8}, ...} -> that dict, checked:
    block sizes of the matrix-vector kinds (sweeps)."""
    if isinstance(spec, dict):
        for kind, sizes in spec.items():
            if kind not in DEFAULT_PREFETCH:
                raise ValueError(f"blocks: expected kinds in {', '.join(DEFAULT_PREFETCH)}, got {kind!r}")
            kind_overrides(sizes, BLOCK_KEYS, f"blocks.{kind}")
        return {kind: dict(sizes) for kind, sizes in spec.items()}
    blocks = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        kind, _, values = item.partition("=")
        parts = values.split("/")
        if kind not in DEFAULT_PREFETCH or len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"blocks: expected kind=block_n/block_k/num_warps with kind in "
                             f"{', '.join(DEFAULT_PREFETCH)}, got {item!r}")  # fmt: skip
        blocks[kind] = {key: int(v) for key, v in zip(BLOCK_KEYS, parts, strict=True) if int(v)}
    return blocks
