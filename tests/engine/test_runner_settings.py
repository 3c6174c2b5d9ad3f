"""FastRunner's settings resolved from a model's shape and a device's facts, without a model or a GPU
(inference/fast/settings.py): the documented default on each supported model, and the four switches."""

import dataclasses
import json
import os

import pytest
import torch

from inference.config import ModelConfig
from inference.fast.settings import PACKED_BLOCKS, SWITCHES, Device, RunnerSettings
from inference.presets import preset_config
from tests.support import ROOT

H200 = Device(gpu=True, hopper=True, multiprocessors=132)
AMPERE = Device(gpu=True, hopper=False, multiprocessors=108)  # no PDL, clusters, bulk prefetch or packed form
CPU = Device(gpu=False, hopper=False, multiprocessors=1)  # Triton's interpreter


@pytest.fixture(autouse=True)
def no_kog_environment(monkeypatch):
    """Each test sets the variables it reads; none leaks in from the shell that runs the suite."""
    for name in [name for name in os.environ if name.startswith("KOG_")]:
        monkeypatch.delenv(name)


def config(name: str) -> ModelConfig:
    if name == "default":
        return ModelConfig.from_hf(json.loads((ROOT / "models/default/config.json").read_text()))
    return ModelConfig.from_hf(preset_config(name))


def resolve(name: str, device: Device = H200, dtype: torch.dtype = torch.bfloat16) -> RunnerSettings:
    return RunnerSettings.resolve(config(name), device, dtype)


def features(settings: RunnerSettings) -> dict:
    return {"pdl": settings.pdl, "packed": settings.packed, "packed_gate_up": settings.packed_gate_up,
            "packed_lane_down": settings.packed_lane_down, "head_screen": settings.head_screen,
            "lane_groups": settings.lane_groups,
            "prefetch_next": settings.attention_prefetch_next}  # fmt: skip


# What each supported model runs with on an H200 (docs/fast-path.md): the packed form on one-lane models, the
# gate/up in 12 bits where a layer's is 48 MiB or more (a Laneformer's too, and then its delayed down-proj), the head
# screen for heads of 32 MiB or more, lane groups where a Laneformer's layers are 32 MiB or more and its weights
# stay bf16 (beside the 12-bit ones one stream decodes faster).
FEATURES = ("packed", "packed_gate_up", "packed_lane_down", "head_screen", "lane_groups")
H200_DEFAULTS = {
    name: dict(zip(FEATURES, values, strict=True))
    for name, values in {
        "laneformer-2b": (False, True, True, True, 1),
        "llama-3.2-1b": (True, True, False, True, 1),
        "qwen3-1.7b": (True, True, False, True, 1),
        "qwen2.5-coder-1.5b": (True, True, False, True, 1),
        "tiny-llama": (True, False, False, False, 1),
        "tiny-laneformer": (False, False, False, False, 1),
        "default": (False, False, False, False, 1),
    }.items()
}


SPLITS_ON_132 = {1: 64, 2: 64, 4: 32, 8: 16, 16: 8}  # KV heads -> splits


@pytest.mark.parametrize("name", list(H200_DEFAULTS))
def test_the_defaults_of_each_model_on_an_h200(name):
    settings = resolve(name)
    assert features(settings) == {"pdl": True, "prefetch_next": True, **H200_DEFAULTS[name]}
    one_lane = config(name).num_lanes == 1
    assert settings.early == ({"qkv", "o"} if one_lane else set())
    gate_up = 3 if one_lane else 2 if settings.lane_groups == 2 else 1
    assert settings.prefetch == {"qkv": 1, "o": 64, "gate_up": gate_up, "down": 1}
    assert (settings.screen_sampled_temperature, settings.screen_leave_share) == (0.3, 0.25)
    # a lane group's KV heads (the model's on one stream) fill the 132 multiprocessors once, in powers of two
    assert settings.attention_splits == SPLITS_ON_132[config(name).num_kv_heads // settings.lane_groups]


def test_each_lane_groups_attention_fills_the_gpu_by_itself_beside_the_12_bit_gate_up(monkeypatch):
    # laneformer-2b's 16 KV heads: by default one stream beside the 12-bit gate/up, all 16 taking 8 splits
    assert (resolve("laneformer-2b").lane_groups, resolve("laneformer-2b").attention_splits) == (1, 8)
    # groups asked for: 8 KV heads a group take 16 splits each
    monkeypatch.setenv("KOG_LANE_GROUPS", "1")
    assert (resolve("laneformer-2b").lane_groups, resolve("laneformer-2b").attention_splits) == (2, 16)
    # beside the bf16 gate/up the groups are the default and keep the whole model's 8
    monkeypatch.delenv("KOG_LANE_GROUPS")
    monkeypatch.setenv("KOG_PACKED", "0")
    settings = resolve("laneformer-2b")
    assert (settings.lane_groups, settings.packed_gate_up, settings.attention_splits) == (2, False, 8)
    assert not settings.packed_lane_down


def test_packed_blocks_are_the_kinds_defaults_but_qwen3s_gate_up():
    assert resolve("llama-3.2-1b").packed_blocks == PACKED_BLOCKS
    qwen3 = resolve("qwen3-1.7b").packed_blocks
    assert qwen3["gate_up"] == {"ahead": 1, "items": 2}
    others = {k: v for k, v in PACKED_BLOCKS.items() if k != "gate_up"}
    assert {k: v for k, v in qwen3.items() if k != "gate_up"} == others


@pytest.mark.parametrize("name", list(H200_DEFAULTS))
def test_off_a_hopper_gpu_only_the_head_screen_and_lane_groups_stay(name):
    on_ampere = features(resolve(name, AMPERE))
    # (laneformer-2b's bf16 gate/up takes its lane groups back)
    groups = 2 if name == "laneformer-2b" else features(resolve(name))["lane_groups"]
    assert on_ampere == {**features(resolve(name)), "pdl": False, "packed": False, "packed_gate_up": False,
                         "packed_lane_down": False, "prefetch_next": False, "lane_groups": groups}  # fmt: skip
    # the interpreter: every default off (it gains nothing by them), one split
    cpu = resolve(name, CPU)
    assert features(cpu) == dict.fromkeys(features(cpu), False) | {"lane_groups": 1}
    assert cpu.attention_splits == 1


def test_an_fp32_model_keeps_its_bf16_kernels():
    assert not resolve("llama-3.2-1b", H200, torch.float32).packed


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["yes", "2", "on", "-1"])
def test_each_switch_refuses_what_it_does_not_know(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError, match=f"^{name}: expected 0 or 1 \\(or unset for the default\\), got '{value}'"
    ):
        resolve("tiny-llama")


def test_zero_turns_each_default_off(monkeypatch):
    for name in SWITCHES:
        monkeypatch.setenv(name, "0")
    assert features(resolve("laneformer-2b")) == {**dict.fromkeys(features(resolve("laneformer-2b")), False),
                                                  "lane_groups": 1, "prefetch_next": True}  # fmt: skip
    packed_off = resolve("qwen3-1.7b")
    assert not packed_off.packed and not packed_off.packed_gate_up
    monkeypatch.setenv("KOG_PACKED", " ")  # blank: the default
    assert resolve("qwen3-1.7b").packed_gate_up


def test_one_asks_for_a_feature_where_the_default_leaves_it_off(monkeypatch):
    monkeypatch.setenv("KOG_HEAD_SCREEN", "1")
    monkeypatch.setenv("KOG_PACKED", "1")
    on_cpu = resolve("tiny-llama", CPU)  # the interpreter runs both
    assert on_cpu.head_screen and on_cpu.packed and not on_cpu.packed_gate_up  # the tiny gate/up stays bf16
    monkeypatch.setenv("KOG_LANE_GROUPS", "1")
    monkeypatch.delenv("KOG_PACKED")
    assert resolve("tiny-laneformer", CPU).lane_groups == 2


def test_one_refuses_what_cannot_run_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KOG_PDL", "1")
    with pytest.raises(ValueError, match="KOG_PDL=1: programmatic dependent launch needs a Hopper GPU"):
        resolve("tiny-llama", AMPERE)
    monkeypatch.delenv("KOG_PDL")
    monkeypatch.setenv("KOG_LANE_GROUPS", "1")
    with pytest.raises(ValueError, match="lane_groups: two groups need .*from KOG_LANE_GROUPS"):
        resolve("llama-3.2-1b")


def test_a_replaced_setting_is_checked_against_the_model():
    settings = resolve("tiny-laneformer")
    cfg = config("tiny-laneformer")
    settings.check(cfg)
    for change, what in (({"lane_groups": 3}, "lane_groups: expected 1 or 2"),
                         ({"packed": True}, "packed: the 12-bit"),
                         ({"attention_splits": 3}, "attention_splits: expected a power of two"),
                         ({"lanes": 1}, "lanes: the settings are for 1 lanes")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            dataclasses.replace(settings, **change).check(cfg)
    with pytest.raises(ValueError, match="lane_groups: two groups"):  # d = 0: every layer sums at once
        dataclasses.replace(settings, lane_groups=2).check(ModelConfig.from_hf(
            {**preset_config("tiny-laneformer"), "broadcast_delay": 0}))  # fmt: skip
    dataclasses.replace(settings, packed_gate_up=True).check(cfg)  # a Laneformer's: norm and SiLU fused
    llama = resolve("tiny-llama")
    with pytest.raises(ValueError, match="packed_gate_up: a one-lane model's needs packed"):
        dataclasses.replace(llama, packed=False, packed_gate_up=True).check(config("tiny-llama"))


def test_a_laneformer_packs_its_gate_up_alone(monkeypatch):
    """KOG_PACKED on a Laneformer: the gate/up in 12 bits where a layer's is large; the o-proj and down-proj, which
    reduce across lanes, stay bf16."""
    monkeypatch.setenv("KOG_PACKED", "1")
    on = resolve("laneformer-2b")
    assert (on.packed, on.packed_gate_up) == (False, True)
    assert on.packed_blocks["lanes_gate_up"] == PACKED_BLOCKS["lanes_gate_up"]
    small = resolve("tiny-laneformer")
    assert (small.packed, small.packed_gate_up) == (False, False)


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve("tiny-llama").pdl = False
