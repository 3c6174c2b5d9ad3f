"""The fast runner's settings: the defaults measured on an H200 (weight tiles before each kernel's wait, the
kinds that let the next kernel launch early, when the head screen is on), the parsers that turn the KOG_*
environment variables and FastRunner's arguments into checked overrides (for sweeps),
and RunnerSettings.resolve, which FastRunner (inference/fast/runner.py) calls once, when it is built: every
setting from the environment, then the constructor's argument over it, checked against what the device can do.
The resolution needs facts about the device and the model, not the model itself (tests/engine/test_runner_settings.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from common.env import env_number
from inference.fast.head_choice import BREAK_EVEN_SHARE
from inference.fast.prefill import block_overrides

# Weight tiles each matrix-vector kind loads before it waits on the previous kernel (kernels' `prefetch`;
# more than a row has means all). The o-proj takes all of its tiles: attention before it reads little, so
# its weights stream while attention runs (H200, in turns on one machine: llama
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


def env_count(env_name: str, default: int = 0, minimum: int = 0) -> int:
    """An integer >= minimum from the environment (unset or blank: default), refused naming the variable."""
    what = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
    return int(env_number(env_name, default, what, integer=True, minimum=minimum))


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
# (laneformer-2b on an H200, in turns: 800 -> 844 tok/s; 4 groups 832).
LANE_GROUP_KEYS = ("groups",)
# Matrix-vector kinds that let the next kernel launch before their own wait (kernels' `trigger_early`).
EARLY_KINDS = ("qkv", "o", "gate_up", "down")
# One-lane models (Llama, Qwen3): the q|k|v and o-proj kernels trigger early, so the attention's programs are
# resident (and load their first key block) while q|k|v streams, and the gate/up programs while the attention and
# the o-proj run, each with 3 tiles of the pair in flight before its wait. H200, in
# turns (docs/fast-path.md): llama-3.2-1b 1,402 -> 1,419 tok/s, qwen3-1.7b 942 -> 958; 2 or 4 tiles, or
# either trigger alone, gained less; an early down-proj lost 8% on qwen3. Laneformer's lane groups: no change.
ONE_LANE_EARLY = {"qkv": 1, "o": 1}
ONE_LANE_PREFETCH = {"gate_up": 3}
# The o-proj, gate/up and down-proj of one-lane models can read their weights in 12 bits on the tensor cores
# (kernels/packed_mma_gemv.py); KOG_PACKED_BLOCKS=o=1/8/8/1,down=1/16/4/2 sets a kind's M-tiles a program,
# programs along K, chunks ahead and items, the blocks of M-tiles a program takes in turn, and for the glu kind a
# fifth, how many of its chunks ahead it loads before its wait (0 keeps the default:
# PACKED_DEFAULTS, then the launcher's choice; sweeps). A packed gate/up needs the other two: the o-proj clears
# the sums it adds into, the down-proj reads them. Its input is x * g, the norm's scalar written once a launch
# (round 34's, rmsnorm(x) * g built in every program, ran far slower than the bf16 kernel: H200, qwen3-1.7b 947
# tok/s against 1,089; docs/fast-path.md).
# `glu` packs the gate/up another way (kernels/packed_mma_glu.py): gate and up rows interleaved, whole-K programs
# that apply the norm and the SiLU themselves, so it needs neither neighbour packed; not a default (H200, round 36:
# qwen3-1.7b 1,086 tok/s at 2 M-tiles a program and 12 chunks ahead against 1,095 bf16, llama-3.2-1b 1,663 against
# gate_up's 1,708).
# `qkv` packs the q|k|v of layers 1 on (layer 0's reads the token's embedding row) as a normed launch into fp32
# sums that the attention scales by the norm's scalar (decode_attention's qkv_scale); the o-proj clears them, so
# it needs `o`; a model with q|k|v biases keeps its bf16 q|k|v. Not a default: its own launch is ~17 us a step
# shorter on qwen3-1.7b, the down-proj before it and the attention after it ~20-35 us longer (H200, round 37:
# 1,072-1,088 tok/s against 1,090-1,098).
PACKED_KINDS = ("qkv", "o", "gate_up", "down", "glu")
DEFAULT_PACKED_KINDS = ("o", "down")  # KOG_PACKED=1's, and a Hopper GPU's without it
# ... and the gate/up too where a layer's is at least this many bf16 bytes: the packed gate/up saves a quarter of
# its bytes, and gives part of it back at its edges (the o-proj clears its sums, the down-proj's programs find
# room later): H200, in turns (docs/fast-path.md): llama-3.2-1b (64 MiB
# a layer) 1,719-1,727 tok/s against 1,638-1,650; qwen3-1.7b (48 MiB) 1,094-1,107 against 1,087-1,092 over ten
# and six runners in runs 257 and 259 (round 38), 1,095-1,114 against 1,098-1,104 in round 37's four pairs: +0.7%
# over all of them, while the runners of one setting lie 1-1.7% apart.
PACKED_GATE_UP_MIN_BYTES = 48 << 20
PACKED_KEYS = ("block_m", "split", "ahead", "items", "before")
# KOG_PACKED_BLOCKS may leave the last (before: chunks loaded before the wait, of `ahead`; the glu kind's alone) out
PACKED_OPTIONAL_KEYS = 1
# Chunks a program loads before its wait (and keeps in flight). The o-proj takes all of its (4): the attention
# before it reads little. The down-proj takes 2 of its 4: its programs launch while gate/up streams, and loading
# all of their weights then slows gate/up (H200, in turns, docs/fast-path.md:
# qwen3-1.7b 1,083 tok/s at 2, 1,065 at 1, 1,014 at all 4; llama-3.2-1b 1,643, 1,617, 1,598; the o-proj at 2:
# 1,076 and 1,634). The o-proj's programs take 2 M-tiles (2 warps): qwen3-1.7b 1,099-1,103 against 1,090-1,093
# at 1 (run 235, each built twice), llama-3.2-1b 1,650-1,661 against 1,657-1,658.
PACKED_DEFAULTS = {
    "qkv": {},
    "o": {"block_m": 2, "ahead": 8},
    "gate_up": {"ahead": 2},
    "down": {"ahead": 2},
    "glu": {"block_m": 2, "ahead": 12},
}
# ... and where one shape measured best apart, its blocks by (kind, N, K), over PACKED_DEFAULTS and under any
# override. qwen3-1.7b's gate/up ([2 x 6,144, 2,048], 768 M-tiles): 1 chunk before its wait and 2 items a program
# (3,072 programs of 8 chunks, a chunk in flight across the two): its programs, fewer and lighter before their
# wait, slow the attention and o-proj they launch beside less (o-proj 75-78 us a step against 85-92) for +4-6 us
# of their own. H200, four runners of each in turns (docs/fast-path.md):
# 1,108-1,114 tok/s against 1,092-1,104 (1 chunk ahead alone 1,088-1,109, with split 4 1,104-1,111; 4 items, or
# split 4 with 2 items, 997-1,057). llama-3.2-1b's gate/up ([2 x 8,192, 2,048]) lost with the same blocks
# (1,612-1,630 against 1,635-1,714: its own launch 229 -> 274 us), so it keeps the kind's default.
PACKED_SHAPE_DEFAULTS = {("gate_up", 2 * 6144, 2048): {"ahead": 1, "items": 2}}
# The residual's addresses a runner on a GPU times while it builds, keeping the fastest
# (inference/fast/residual_placement.py): about one address in five makes qwen3-1.7b's step ~2.5% slower on an
# H200; its runners placed 1,112-1,121 tok/s against 1,076-1,113 (docs/fast-path.md).
RESIDUAL_CANDIDATES = 8
# The smallest head the screen is on for by default: below it the head's read is short beside the screen's two
# launches (H200, models/default's 8,192 x 384 head: 16,140 tok/s whole, 15,426 screened; laneformer-2b's 192 MiB
# +1%, llama-3.2-1b's 501 MiB +9%).
SCREEN_MIN_HEAD_BYTES = 32 << 20
# The highest temperature whose sampled steps read the head through its screen (uses_screen).
SAMPLED_SCREEN_TEMPERATURE = 0.3


def packed_kinds(spec: bool | str, what: str, default: bool, on_kinds: frozenset[str]) -> frozenset[str]:
    """KOG_PACKED's form ('' for the default, 0, 1, or kinds joined by '+': 'o+down') or the argument's (a bool, or
    that string) -> the packed kinds, checked; on (1, or the default where it is on) packs on_kinds."""
    if isinstance(spec, bool) or spec in ("", "0", "1"):
        on = default if spec == "" else bool(int(spec)) if isinstance(spec, str) else spec
        return on_kinds if on else frozenset()
    kinds = frozenset(spec.split("+"))
    if not kinds <= set(PACKED_KINDS):
        raise ValueError(
            f"{what}: expected 0, 1 or kinds joined by '+' from {', '.join(PACKED_KINDS)}, got {spec!r}"
        )
    if "gate_up" in kinds and not {"o", "down"} <= kinds:
        raise ValueError(f"{what}: a packed gate_up needs o and down packed too (the o-proj clears its sums, the "
                         f"down-proj reads them), got {spec!r}")  # fmt: skip
    if "qkv" in kinds and "o" not in kinds:
        raise ValueError(f"{what}: a packed qkv needs o packed too (the o-proj clears its sums), "
                         f"got {spec!r}")  # fmt: skip
    if {"gate_up", "glu"} <= kinds:
        raise ValueError(f"{what}: gate_up and glu are two ways to pack the same matrices, got {spec!r}")
    return kinds


def block_spec(spec: str | dict[str, dict[str, int]], keys=BLOCK_KEYS, kinds=tuple(DEFAULT_PREFETCH),
               what: str = "blocks", optional: int = 0) -> dict[str, dict[str, int]]:  # fmt: skip
    """KOG_BLOCKS's form, 'down=2/1024/8,o=4/512/4' (block_n/block_k/num_warps; 0 keeps the kernel's choice), or
    the dict it stands for, {'down': {'block_n': 2, 'block_k': 1024, 'num_warps': 8}, ...} -> that dict, checked:
    block sizes of the matrix-vector kinds (sweeps). KOG_PACKED_BLOCKS's the same with PACKED_KEYS and kinds, whose
    last `optional` keys may be left out."""
    form = "/".join(keys)
    if isinstance(spec, dict):
        for kind, sizes in spec.items():
            if kind not in kinds:
                raise ValueError(f"{what}: expected kinds in {', '.join(kinds)}, got {kind!r}")
            kind_overrides(sizes, keys, f"{what}.{kind}")
        return {kind: dict(sizes) for kind, sizes in spec.items()}
    blocks = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        kind, _, values = item.partition("=")
        parts = values.split("/")
        fields = len(keys) - optional <= len(parts) <= len(keys)
        if kind not in kinds or not fields or not all(p.isdigit() for p in parts):
            raise ValueError(f"{what}: expected kind={form} with kind in {', '.join(kinds)}, got {item!r}")
        blocks[kind] = {key: int(v) for key, v in zip(keys, parts, strict=False) if int(v)}
    return blocks


@dataclass(frozen=True)
class AttentionSettings:
    """decode_attention's settings: KOG_ATTN_SPLITS / KOG_ATTN_BLOCK_T / KOG_ATTN_WARPS and the switches of
    SWITCH_ENV (0|1), then the `attention` argument's keys over them (ATTENTION_KEYS; for sweeps)."""

    splits: int | None  # of each KV head's keys (None: default_splits, the KV heads filling the GPU once)
    block_t: int  # keys a program takes at a time
    num_warps: int | None  # None: the kernel's choice
    maxnreg: int | None  # a register cap (sweeps)
    kv_evict_first: bool  # the cache read with the weights' evict-first hint (decode_attention's)
    prefetch_next: bool  # the L2 prefetch of the next layer's first keys and values
    cluster: bool | None  # the split merge through a thread-block cluster (None: the kernel's choice)
    push: bool | None  # the cluster merge's partials pushed into shared memory (None: the kernel's choice)

    @classmethod
    def resolve(cls, argument: dict[str, int] | None, *, sm90: bool,
                prefetch_possible: bool) -> AttentionSettings:  # fmt: skip
        """sm90: the device is a Hopper GPU or later (clusters); prefetch_possible: decode_attention can prefetch
        the next layer for this cache (kernels/decode_attention.py's prefetch_next_possible)."""
        env_switches = ",".join(
            f"{key}={os.environ[name]}" for name, key in SWITCH_ENV if os.environ.get(name)
        )
        attention = {"splits": env_count("KOG_ATTN_SPLITS"),
                     "block_t": env_count("KOG_ATTN_BLOCK_T", 64, minimum=1),  # no "0: the kernel's choice" here
                     "num_warps": env_count("KOG_ATTN_WARPS"),
                     **kind_overrides(env_switches, ATTENTION_KEYS, "KOG_ATTN_*", ATTENTION_SWITCHES),
                     **kind_overrides(argument or {}, ATTENTION_KEYS, "attention", ATTENTION_SWITCHES)}  # fmt: skip
        # Each layer's attention asks L2 for the next layer's first block of keys and values (decode_attention's
        # next_layer; the measurements are in kernels/decode_attention.py): on wherever it can run;
        # KOG_ATTN_PREFETCH_NEXT=0|1 (or the `prefetch_next` key) overrides it.
        prefetch_next = bool(attention.get("prefetch_next", prefetch_possible))
        if prefetch_next and not prefetch_possible:
            raise ValueError("prefetch_next: the L2 prefetch needs a Hopper GPU and cache rows of a multiple of "
                             "16 bytes (set it to 0 or leave it unset)")  # fmt: skip
        # KOG_ATTN_CLUSTER=1|0 (or the `cluster` key) forces the split merge through a thread-block cluster or
        # through the arrival counter (unset: the kernel's choice, clusters on a GPU).
        cluster = bool(attention["cluster"]) if "cluster" in attention else None
        if cluster and not sm90:
            raise ValueError(
                "cluster: thread-block clusters need a Hopper GPU (set it to 0 or leave it unset)"
            )
        # KOG_ATTN_PUSH=1|0 (or the `push` key): the cluster merge pushes the partials into the owners' shared
        # memory or sends them through global memory and a cluster barrier (decode_attention's push; unset: the
        # kernel's choice, the push wherever the cluster merge runs).
        push = bool(attention["push"]) if "push" in attention else None
        if push and (cluster is False or not sm90):
            raise ValueError(
                "push: the push merge runs in thread-block clusters (a Hopper GPU, cluster not 0)"
            )
        return cls(splits=attention["splits"] or None, block_t=attention["block_t"],
                   num_warps=attention["num_warps"] or None, maxnreg=attention.get("maxnreg"),
                   kv_evict_first=bool(attention.get("kv_evict_first", True)), prefetch_next=prefetch_next,
                   cluster=cluster, push=push)  # fmt: skip


@dataclass(frozen=True)
class ScreenSettings:
    """The head screen (kernels/lm_head_screen.py): whether the runner builds one, and which requests read it."""

    on: bool
    sampled_temperature: float  # sampled steps go through the screen up to this temperature (uses_screen)
    leave_share: float  # of the vocabulary read again a step, above which a sampled request leaves it

    @classmethod
    def resolve(cls, argument: bool | None, *, device_type: str, head_bytes: int) -> ScreenSettings:
        """argument: FastRunner's head_screen (None: KOG_HEAD_SCREEN=0|1, unset: the default below);
        head_bytes: the bytes of the head's weight."""
        # Greedy steps find the head's argmax through an int8 copy of it and read only the candidate rows again in
        # bf16 (kernels/lm_head_screen.py: the same token, about half the head's bytes). On by default on a GPU
        # for heads of SCREEN_MIN_HEAD_BYTES or more; KOG_HEAD_SCREEN=0|1 or the argument override (the
        # interpreter gains nothing by it).
        if argument is None:
            setting = os.environ.get("KOG_HEAD_SCREEN", "")
            if setting not in ("", "0", "1"):
                raise ValueError(f"KOG_HEAD_SCREEN: expected 0 or 1 (or unset), got {setting!r}")
            large = device_type == "cuda" and head_bytes >= SCREEN_MIN_HEAD_BYTES
            argument = setting == "1" if setting else large
        # KOG_HEAD_SCREEN_SAMPLED=T overrides the temperature (-1: never); KOG_HEAD_SCREEN_LEAVE=share the share
        # that sends a request to the whole head (head_choice.ScreenWatch; 1: never).
        return cls(on=bool(argument),
                   sampled_temperature=env_number("KOG_HEAD_SCREEN_SAMPLED", SAMPLED_SCREEN_TEMPERATURE,
                                                  "a temperature (-1: never)", minimum=-math.inf),
                   leave_share=env_number("KOG_HEAD_SCREEN_LEAVE", BREAK_EVEN_SHARE, "a share in [0, 1]",
                                          maximum=1))  # fmt: skip


@dataclass(frozen=True)
class RunnerSettings:
    """Every setting of a FastRunner, resolved and checked in one place (FastRunner resolves them once its KV
    cache exists, which the L2 prefetch's check reads; a bad one ends the build there)."""

    use_pdl: bool  # programmatic dependent launch (asked for, and a Hopper GPU)
    attention: AttentionSettings
    head_blocks: dict[str, int | None]  # lm_head's block_n, row_blocks, num_warps (None: its own choice)
    prefill_blocks: tuple[dict[str, int], dict[str, int]]  # the prefill attention's and norm kernels' blocks
    prefetch: dict[str, int]  # tiles before the wait, the overrides only (prefetch_tiles: with the defaults)
    row_blocks: dict[str, int]  # rmsnorm_gemv's row blocks a program, by kind (unset: its own choice)
    blocks: dict[str, dict[str, int]]  # the matrix-vector kinds' block sizes (block_spec)
    screen: ScreenSettings
    lane_groups: int | None  # how many (None: FastRunner._lane_groups' choice, by the layers' size)
    early: frozenset[str]  # the kinds whose next kernel may launch before their wait
    one_lane: bool
    packed: frozenset[str]  # the kinds read from 12-bit weights on the tensor cores (one lane; PACKED_KINDS)
    # their block_m / split / ahead / items: PACKED_DEFAULTS, PACKED_SHAPE_DEFAULTS, then overrides
    packed_blocks: dict[str, dict[str, int]]
    residual_candidates: int  # the residual's addresses timed while building (1: none, x stays where it lies)

    def prefetch_tiles(self, grouped: bool) -> dict[str, int]:
        """Weight tiles before each kind's wait, for a runner with lane groups (grouped) or without."""
        return {**DEFAULT_PREFETCH, **(GROUPED_PREFETCH if grouped else {}),
                **(ONE_LANE_PREFETCH if self.one_lane else {}), **self.prefetch}  # fmt: skip

    @classmethod
    def resolve(cls, *, lanes: int, device_type: str, sm90: bool, head_bytes: int, prefetch_next_possible: bool,
                use_pdl: bool = True, prefetch: dict[str, int] | None = None,
                row_blocks: dict[str, int] | None = None, blocks: str | dict[str, dict[str, int]] = "",
                head_blocks: dict[str, int] | None = None, attention: dict[str, int] | None = None,
                lane_groups: dict[str, int] | None = None, early: dict[str, int] | None = None,
                head_screen: bool | None = None, packed: bool | str | None = None, bf16: bool = True,
                packed_blocks: str | dict[str, dict[str, int]] = "",
                gate_up_shape: tuple[int, int] = (0, 0),
                residual_candidates: int | None = None) -> RunnerSettings:  # fmt: skip
        """FastRunner's keyword arguments (the same names and defaults) over the KOG_* environment, given what the
        device and the model are: lanes (the model's), device_type ('cuda', 'cpu', 'meta'), sm90 (a Hopper GPU or
        later), head_bytes (the head weight's), prefetch_next_possible (decode_attention can prefetch the next
        layer for the runner's cache), bf16 (the model's weights are bf16), gate_up_shape (a layer's gate and up
        rows as one [N, K] matrix). ValueError names the variable or the argument that is wrong."""
        # KOG_RESIDUAL_CANDIDATES=N (or the argument): the residual's addresses a runner times while building
        # (inference/fast/residual_placement.py); RESIDUAL_CANDIDATES on a GPU, 1 (none timed) elsewhere.
        candidates = env_count("KOG_RESIDUAL_CANDIDATES", RESIDUAL_CANDIDATES if device_type == "cuda" else 1,
                               minimum=1) if residual_candidates is None else residual_candidates  # fmt: skip
        if not isinstance(candidates, int) or isinstance(candidates, bool) or candidates < 1:
            raise ValueError(f"residual_candidates: expected an integer >= 1, got {candidates!r}")
        attention_settings = AttentionSettings.resolve(
            attention, sm90=sm90, prefetch_possible=prefetch_next_possible
        )
        # KOG_HEAD_BLOCK_N / KOG_HEAD_ROW_BLOCKS / KOG_HEAD_WARPS override the head's blocks (0: its own choice).
        head = {"block_n": env_count("KOG_HEAD_BLOCK_N") or None,
                "row_blocks": env_count("KOG_HEAD_ROW_BLOCKS") or None,
                "num_warps": env_count("KOG_HEAD_WARPS") or None,
                **kind_overrides(head_blocks or {}, HEAD_KEYS, "head_blocks")}  # fmt: skip
        # KOG_PREFILL_ATTN / KOG_PREFILL_NORM override the prefill kernels' blocks (prefill.block_overrides).
        prefill_blocks = (
            block_overrides("KOG_PREFILL_ATTN", ("block_m", "block_n", "num_warps", "num_stages")),
            block_overrides("KOG_PREFILL_NORM", ("block_d", "num_warps", "stages")),
        )
        # KOG_PREFETCH=o=4,gate_up=2 overrides the weight tiles loaded before each kind's wait (for sweeps), and
        # KOG_ROW_BLOCKS=gate_up=8 rmsnorm_gemv's row blocks a program (unset: its own choice); the arguments
        # override both.
        prefetch = env_then_argument("KOG_PREFETCH", prefetch, DEFAULT_PREFETCH, "prefetch")
        row_blocks = env_then_argument("KOG_ROW_BLOCKS", row_blocks, ROW_BLOCK_KINDS, "row_blocks")
        # KOG_BLOCKS=down=2/1024/8 overrides the matrix-vector kinds' block sizes (block_spec; for sweeps).
        blocks = {**block_spec(os.environ.get("KOG_BLOCKS", "")), **block_spec(blocks)}
        screen = ScreenSettings.resolve(head_screen, device_type=device_type, head_bytes=head_bytes)
        # KOG_LANE_GROUPS=groups=2 (or the `lane_groups` argument): runner.py's module docstring.
        groups = env_then_argument("KOG_LANE_GROUPS", lane_groups, LANE_GROUP_KEYS, "lane_groups")
        # KOG_EARLY=o=1,qkv=0 (or the `early` argument) overrides the kinds whose next kernel may launch before
        # their wait (sweeps).
        one_lane = lanes == 1
        early = {**(ONE_LANE_EARLY if one_lane else {}),
                 **env_then_argument("KOG_EARLY", early, EARLY_KINDS, "early", EARLY_KINDS)}  # fmt: skip
        # One-lane models' matrix kinds from 12-bit weights on the tensor cores (kernels/packed_mma_gemv.py): the
        # default for bf16 models on a Hopper GPU; KOG_PACKED=0|1|o+gate_up+down (the kinds) or the argument
        # override (on the CPU the interpreter stands in for the mma; fp32 weights must be bf16 values).
        # the gate/up too where it is large enough (PACKED_GATE_UP_MIN_BYTES)
        large = 2 * math.prod(gate_up_shape) >= PACKED_GATE_UP_MIN_BYTES  # its bf16 bytes
        on_kinds = frozenset(DEFAULT_PACKED_KINDS + (("gate_up",) if large else ()))
        if packed is None:
            on = one_lane and bf16 and device_type == "cuda" and sm90
            packed = packed_kinds(os.environ.get("KOG_PACKED", ""), "KOG_PACKED", on, on_kinds)
        else:
            packed = packed_kinds(packed, "packed", False, on_kinds)
        if packed and not one_lane:
            raise ValueError("packed: the 12-bit o-proj and down-proj serve one-lane models (Llama, Qwen2, Qwen3); "
                             "a Laneformer's reduce across lanes (set it to 0 or leave it unset)")  # fmt: skip
        overrides = {
            **block_spec(os.environ.get("KOG_PACKED_BLOCKS", ""), PACKED_KEYS, PACKED_KINDS, "KOG_PACKED_BLOCKS",
                         PACKED_OPTIONAL_KEYS),
            **block_spec(packed_blocks, PACKED_KEYS, PACKED_KINDS, "packed_blocks"),
        }  # fmt: skip
        if any("before" in sizes for kind, sizes in overrides.items() if kind != "glu"):
            raise ValueError(f"KOG_PACKED_BLOCKS / packed_blocks: `before` is the glu kind's alone (the other kinds "
                             f"load all `ahead` chunks before their wait), got {overrides}")  # fmt: skip
        shapes = {"gate_up": tuple(gate_up_shape)}  # the kinds with a shape of their own measured
        packed_settings = {
            kind: {**PACKED_DEFAULTS[kind], **PACKED_SHAPE_DEFAULTS.get((kind, *shapes.get(kind, ())), {}),
                   **overrides.get(kind, {})}
            for kind in PACKED_KINDS
        }  # fmt: skip
        return cls(use_pdl=bool(use_pdl and sm90), attention=attention_settings, head_blocks=head,
                   prefill_blocks=prefill_blocks, prefetch=prefetch, row_blocks=row_blocks, blocks=blocks,
                   screen=screen, lane_groups=groups.get("groups"),
                   early=frozenset(kind for kind, on in early.items() if on), one_lane=one_lane,
                   packed=packed, packed_blocks=packed_settings, residual_candidates=candidates)  # fmt: skip
