"""The fast runner's settings: one frozen dataclass, resolved once from the model's shape and the device.

RunnerSettings.resolve holds every default and why it is the default (measured on an H200: docs/fast-path.md).
Four environment variables turn a default off or on, for operators and A/B runs (docs/configuration.md):
    KOG_PACKED       0|1  weights in 12 bits: one-lane models' o-proj, down-proj (and large gate/up), a
                          Laneformer's large gate/up (its norm and SiLU in the same launch)
    KOG_HEAD_SCREEN  0|1  greedy steps read the head through its int8 screen
    KOG_LANE_GROUPS  0|1  two lane groups on two streams (Laneformer)
    KOG_PDL          0|1  programmatic dependent launch
Unset keeps the default; 1 asks for the feature where the default leaves it off (an error where it cannot run).
Benchmarks and tests change a setting with dataclasses.replace and pass the result to FastRunner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from inference.config import ModelConfig
from inference.fast.layers import split_from
from kernels import hopper_features, sm_count
from kernels.decode_attention import default_splits

SWITCHES = ("KOG_PACKED", "KOG_HEAD_SCREEN", "KOG_LANE_GROUPS", "KOG_PDL")
# Heads smaller than this read faster whole: the screen's two launches outweigh the bytes it saves.
SCREEN_MIN_HEAD_BYTES = 32 << 20
# Layers smaller than this are launch-bound: a second stream adds waits and saves no memory time.
LANE_GROUP_MIN_LAYER_BYTES = 32 << 20
# A packed gate/up (a layer's, all lanes) saves a quarter of its bytes and gives part back at its edges: it pays
# from this size on.
PACKED_GATE_UP_MIN_BYTES = 48 << 20
# The packed launches' blocks (kernels/packed_mma_gemv.py): the o-proj takes 2 M-tiles a program and loads all its
# chunks before its wait (attention before it reads little); the gate/up and down-proj load 2 of theirs, as more
# would slow the launch they start beside. "lanes_gate_up" (packed_glu_gemv): 6 chunks in flight beat 4 and 8.
PACKED_BLOCKS = {"o": {"block_m": 2, "ahead": 8}, "gate_up": {"ahead": 2}, "down": {"ahead": 2},
                 "lanes_gate_up": {"block_m": 1, "ahead": 6}, "lanes_reduce": {"block_m": 1, "ahead": 6}}  # fmt: skip
# qwen3-1.7b's gate/up [2 x 6,144, 2,048]: fewer, lighter programs slow the attention and o-proj beside them less.
PACKED_SHAPE_BLOCKS = {(2 * 6144, 2048): {"ahead": 1, "items": 2}}


@dataclass(frozen=True)
class Device:
    """What the settings ask of the device the runner is built on."""

    gpu: bool  # a CUDA device (the kernels compile for it; elsewhere Triton's interpreter runs them)
    hopper: bool  # sm_90 or later: PDL, thread-block clusters, the bulk L2 prefetch, the packed form's loads
    multiprocessors: int  # what a grid fills once (1 under the interpreter: few large programs run fastest)

    @classmethod
    def of(cls, device: torch.device) -> Device:
        gpu = device.type == "cuda"
        return cls(gpu=gpu, hopper=gpu and hopper_features(device), multiprocessors=sm_count(device))


def switch(name: str) -> bool | None:
    """An operational variable of SWITCHES: None when unset or blank, else its 0 or 1, refused naming it."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}: expected 0 or 1 (or unset for the default), got {value!r}")
    return None if value == "" else value == "1"


@dataclass(frozen=True)
class RunnerSettings:
    """Every setting of a FastRunner. The launches read them here; nothing copies them."""

    lanes: int  # the model's: one-lane models trigger early and take more gate/up tiles
    pdl: bool  # programmatic dependent launch (a Hopper GPU)
    packed: bool  # one lane: the o-proj of layers 1 on and every down-proj in 12 bits on the tensor cores
    # the gate/up in 12 bits: one lane, of layers 1 on, into sums the packed down-proj reads (needs `packed`);
    # lanes, every layer's, its norm and SiLU fused (the bf16 down-proj reads h as ever)
    packed_gate_up: bool
    packed_blocks: dict[str, dict[str, int]]  # packed_mma_gemv's blocks by kind: o, gate_up, down
    packed_lane_down: bool  # a Laneformer's down-proj beside its 12-bit gate/up (not a 'sum' layer's)
    head_screen: bool  # an int8 copy of the head that greedy (and cool sampled) steps read first
    lane_groups: int  # streams the lanes of delayed layers decode on (1: one)
    attention_splits: int  # of each KV head's keys: enough programs to fill the GPU (resolve says whose)
    attention_prefetch_next: bool  # each layer's attention asks L2 for the next layer's first keys
    screen_sampled_temperature: float = 0.3  # sampled steps up to it read the screen: few rows reach the draw
    screen_leave_share: float = 0.25  # of the vocabulary read again: past it, the screen costs the head

    @property
    def early(self) -> frozenset[str]:
        """The kinds whose next kernel launches before their wait: one lane's q|k|v and o-proj, so the attention's
        and the gate/up's programs are resident while they stream (a Laneformer's lane groups gain nothing)."""
        return frozenset(("qkv", "o")) if self.lanes == 1 else frozenset()

    @property
    def prefetch(self) -> dict[str, int]:
        """Weight tiles each bf16 matrix-vector kind loads before its wait: the o-proj all of them (attention
        before it reads little); the gate/up 3 after an early trigger (one lane), 2 beside another lane group."""
        gate_up = 3 if self.lanes == 1 else 2 if self.lane_groups > 1 else 1
        return {"qkv": 1, "o": 64, "gate_up": gate_up, "down": 1}

    @classmethod
    def resolve(cls, cfg: ModelConfig, device: torch.device | Device, dtype: torch.dtype) -> RunnerSettings:
        """The defaults for this model (its shape and weights' dtype) on this device, then SWITCHES over them;
        checked. ValueError names the variable that asks for what cannot run."""
        facts = device if isinstance(device, Device) else Device.of(device)
        gpu, hopper, item = facts.gpu, facts.hopper, dtype.itemsize
        one_lane = cfg.num_lanes == 1
        head_bytes = cfg.vocab_size * cfg.hidden_size * item
        q_rows, kv_rows = cfg.heads_per_lane * cfg.head_dim, cfg.kv_heads_per_lane * cfg.head_dim
        layer_bytes = (
            cfg.num_lanes * cfg.hidden_size * (2 * q_rows + 2 * kv_rows + 3 * cfg.ffn_per_lane) * item
        )
        gate_up_shape = (2 * cfg.ffn_per_lane, cfg.hidden_size)
        groups_pay = cfg.num_lanes % 2 == 0 and split_from(cfg) < cfg.num_layers
        defaults = {
            "KOG_PACKED": dtype == torch.bfloat16 and hopper,  # the mma needs sm_90's loads
            "KOG_HEAD_SCREEN": gpu and head_bytes >= SCREEN_MIN_HEAD_BYTES,  # the interpreter gains nothing
            "KOG_LANE_GROUPS": gpu and groups_pay and layer_bytes >= LANE_GROUP_MIN_LAYER_BYTES,
            "KOG_PDL": hopper,
        }
        on = {
            name: default if (value := switch(name)) is None else value for name, default in defaults.items()
        }
        if on["KOG_PDL"] and not hopper:
            raise ValueError(
                "KOG_PDL=1: programmatic dependent launch needs a Hopper GPU (set 0 or unset it)"
            )
        gate_up_bytes = cfg.num_lanes * gate_up_shape[0] * gate_up_shape[1] * 2
        packed_gate_up = on["KOG_PACKED"] and gate_up_bytes >= PACKED_GATE_UP_MIN_BYTES
        # beside the 12-bit gate/up and down-proj one stream decodes faster; KOG_LANE_GROUPS=1 still asks for groups
        lane_groups = 2 if on["KOG_LANE_GROUPS"] and (not packed_gate_up or switch("KOG_LANE_GROUPS")) else 1
        # a lane group's KV heads fill the GPU by themselves beside a 12-bit gate/up (a bf16 one's programs need room)
        attention_heads = cfg.num_kv_heads // (lane_groups if packed_gate_up else 1)
        settings = cls(lanes=cfg.num_lanes, pdl=on["KOG_PDL"], packed=on["KOG_PACKED"] and one_lane,
                       packed_gate_up=packed_gate_up, packed_blocks=packed_blocks(gate_up_shape),
                       packed_lane_down=packed_gate_up and not one_lane,
                       head_screen=on["KOG_HEAD_SCREEN"], lane_groups=lane_groups,
                       attention_splits=default_splits(attention_heads, facts.multiprocessors),
                       attention_prefetch_next=hopper and cfg.head_dim * item % 16 == 0)  # fmt: skip
        try:
            settings.check(cfg)
        except ValueError as e:
            raise ValueError(
                f"{e} (from {', '.join(n for n in SWITCHES if os.environ.get(n))} or the defaults)"
            ) from None
        return settings

    def check(self, cfg: ModelConfig) -> None:
        """ValueError, naming the field, where these settings cannot run the model."""
        if self.lanes != cfg.num_lanes:
            raise ValueError(f"lanes: the settings are for {self.lanes} lanes, the model has {cfg.num_lanes}")
        if self.packed and cfg.num_lanes != 1:
            raise ValueError("packed: the 12-bit o-proj and down-proj serve one-lane models (Llama, Qwen2, "
                             "Qwen3); a Laneformer reduces across lanes")  # fmt: skip
        if self.packed_gate_up and cfg.num_lanes == 1 and not self.packed:
            raise ValueError(
                "packed_gate_up: a one-lane model's needs packed (the o-proj clears its sums, the down-proj "
                "reads them)"
            )
        if self.lane_groups not in (1, 2):
            raise ValueError(f"lane_groups: expected 1 or 2, got {self.lane_groups}")
        if self.lane_groups == 2 and (cfg.num_lanes % 2 or split_from(cfg) == cfg.num_layers):
            raise ValueError("lane_groups: two groups need an even number of lanes and delayed reductions "
                             f"(this model: {cfg.num_lanes} lanes, delay {cfg.broadcast_delay})")  # fmt: skip
        if self.attention_splits < 1 or self.attention_splits & (self.attention_splits - 1):
            raise ValueError(f"attention_splits: expected a power of two, got {self.attention_splits}")


def packed_blocks(gate_up_shape: tuple[int, int]) -> dict[str, dict[str, int]]:
    """PACKED_BLOCKS, with the gate/up's own where its shape [N, K] measured best apart."""
    return {
        **PACKED_BLOCKS,
        "gate_up": PACKED_SHAPE_BLOCKS.get(tuple(gate_up_shape), PACKED_BLOCKS["gate_up"]),
    }
