"""FastRunner's settings resolved without a model or a GPU (inference/fast/settings.py): the KOG_* environment, the
constructor's arguments over it, and what the device can do (told, not asked: these run anywhere)."""

import os
import re

import pytest

from inference.fast.head_choice import BREAK_EVEN_SHARE
from inference.fast.settings import (
    DEFAULT_PREFETCH,
    PACKED_DEFAULTS,
    PACKED_GATE_UP_MIN_BYTES,
    PACKED_SHAPE_DEFAULTS,
    RESIDUAL_CANDIDATES,
    SAMPLED_SCREEN_TEMPERATURE,
    SCREEN_MIN_HEAD_BYTES,
    RunnerSettings,
    env_count,
)

# A CPU under the interpreter, a Hopper GPU, and the meta tensors a step compiles on (no PDL or
# clusters there, but its cache rows pass prefetch_next_possible).
CPU = {"device_type": "cpu", "sm90": False, "prefetch_next_possible": False}
H200 = {"device_type": "cuda", "sm90": True, "prefetch_next_possible": True}
META = {"device_type": "meta", "sm90": False, "prefetch_next_possible": True}
SMALL_HEAD, LARGE_HEAD = 1 << 20, SCREEN_MIN_HEAD_BYTES
INTEGER_ENV = (
    "KOG_ATTN_SPLITS", "KOG_ATTN_BLOCK_T", "KOG_ATTN_WARPS", "KOG_HEAD_BLOCK_N", "KOG_HEAD_ROW_BLOCKS",
    "KOG_HEAD_WARPS",
)  # fmt: skip


@pytest.fixture(autouse=True)
def no_kog_environment(monkeypatch):
    """Each test sets the variables it reads; none leaks in from the shell that runs the suite."""
    for name in [name for name in os.environ if name.startswith("KOG_")]:
        monkeypatch.delenv(name)


def resolve(device=CPU, lanes=1, head_bytes=SMALL_HEAD, **arguments) -> RunnerSettings:
    return RunnerSettings.resolve(lanes=lanes, head_bytes=head_bytes, **device, **arguments)


def test_the_defaults_on_the_cpu():
    settings = resolve()
    attention = settings.attention
    assert (attention.splits, attention.block_t, attention.num_warps) == (None, 64, None)
    assert attention.maxnreg is None
    assert attention.kv_evict_first and not attention.prefetch_next
    assert attention.cluster is None and attention.push is None  # the kernel's choice
    assert not settings.use_pdl and not settings.screen.on and settings.lane_groups is None
    assert settings.head_blocks == {"block_n": None, "row_blocks": None, "num_warps": None}
    assert settings.prefill_blocks == ({}, {}) and settings.row_blocks == {} and settings.blocks == {}
    assert settings.screen.sampled_temperature == SAMPLED_SCREEN_TEMPERATURE
    assert settings.screen.leave_share == BREAK_EVEN_SHARE


def test_the_defaults_by_device():
    h200 = resolve(H200)
    assert h200.use_pdl and h200.attention.prefetch_next and h200.attention.cluster is None
    assert not resolve(H200, use_pdl=False).use_pdl
    meta = resolve(META)
    assert not meta.use_pdl and meta.attention.prefetch_next


def test_one_lane_models_and_lane_groups_change_the_defaults():
    one = resolve(lanes=1)
    assert one.early == {"qkv", "o"} and one.prefetch_tiles(grouped=False)["gate_up"] == 3
    lanes = resolve(lanes=4)
    assert lanes.early == set()
    assert lanes.prefetch_tiles(grouped=False) == DEFAULT_PREFETCH
    assert lanes.prefetch_tiles(grouped=True) == {**DEFAULT_PREFETCH, "gate_up": 2}
    assert resolve(lanes=4, prefetch={"gate_up": 5}).prefetch_tiles(grouped=True)["gate_up"] == 5


def test_the_attention_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("KOG_ATTN_SPLITS", "8")
    monkeypatch.setenv("KOG_ATTN_BLOCK_T", "32")
    monkeypatch.setenv("KOG_ATTN_CLUSTER", "1")
    attention = resolve(H200).attention
    assert (attention.splits, attention.block_t, attention.cluster) == (8, 32, True)
    attention = resolve(H200, attention={"splits": 16, "cluster": 0}).attention
    assert (attention.splits, attention.block_t, attention.cluster) == (16, 32, False)


def test_the_block_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("KOG_HEAD_BLOCK_N", "4")
    monkeypatch.setenv("KOG_HEAD_WARPS", "8")
    head = resolve(head_blocks={"block_n": 2}).head_blocks
    assert head == {"block_n": 2, "row_blocks": None, "num_warps": 8}
    monkeypatch.setenv("KOG_PREFETCH", "o=4,qkv=2")
    tiles = resolve(lanes=4, prefetch={"o": 8}).prefetch_tiles(grouped=False)
    assert tiles == {**DEFAULT_PREFETCH, "o": 8, "qkv": 2}
    monkeypatch.setenv("KOG_ROW_BLOCKS", "gate_up=4")
    assert resolve(row_blocks={"qkv": 2}).row_blocks == {"gate_up": 4, "qkv": 2}
    monkeypatch.setenv("KOG_BLOCKS", "down=2/1024/8,o=4/512/4")
    blocks = resolve(blocks="down=1/2048/4").blocks
    assert blocks == {"down": {"block_n": 1, "block_k": 2048, "num_warps": 4},
                      "o": {"block_n": 4, "block_k": 512, "num_warps": 4}}  # fmt: skip
    monkeypatch.setenv("KOG_PREFILL_ATTN", "128,64")  # the prefill's: the environment's only
    monkeypatch.setenv("KOG_PREFILL_NORM", "0,8")
    assert resolve().prefill_blocks == ({"block_m": 128, "block_n": 64}, {"num_warps": 8})


def test_lane_groups_and_early_kinds_from_the_environment_then_the_argument(monkeypatch):
    monkeypatch.setenv("KOG_LANE_GROUPS", "groups=2")
    assert resolve(lanes=4).lane_groups == 2
    assert resolve(lanes=4, lane_groups={"groups": 1}).lane_groups == 1
    monkeypatch.setenv("KOG_EARLY", "qkv=0,down=1")
    assert resolve().early == {"o", "down"}
    assert resolve(early={"qkv": 1, "o": 0}).early == {"qkv", "down"}


def test_the_head_screen_is_on_by_default_for_large_heads_on_a_gpu(monkeypatch):
    assert not resolve(CPU, head_bytes=LARGE_HEAD).screen.on  # the interpreter gains nothing by it
    assert resolve(H200, head_bytes=LARGE_HEAD).screen.on
    assert not resolve(H200, head_bytes=LARGE_HEAD - 1).screen.on
    assert resolve(CPU, head_screen=True).screen.on
    assert not resolve(H200, head_bytes=LARGE_HEAD, head_screen=False).screen.on
    monkeypatch.setenv("KOG_HEAD_SCREEN", "1")
    assert resolve(CPU).screen.on
    assert not resolve(CPU, head_screen=False).screen.on  # the argument wins
    monkeypatch.setenv("KOG_HEAD_SCREEN", "0")
    assert not resolve(H200, head_bytes=LARGE_HEAD).screen.on
    monkeypatch.setenv("KOG_HEAD_SCREEN", "yes")
    with pytest.raises(ValueError, match="KOG_HEAD_SCREEN: expected 0 or 1"):
        resolve()


def test_which_requests_read_the_screen(monkeypatch):
    monkeypatch.setenv("KOG_HEAD_SCREEN_SAMPLED", "-1")
    monkeypatch.setenv("KOG_HEAD_SCREEN_LEAVE", "0.5")
    screen = resolve().screen
    assert (screen.sampled_temperature, screen.leave_share) == (-1, 0.5)
    for name, bad in (("KOG_HEAD_SCREEN_SAMPLED", "warm"), ("KOG_HEAD_SCREEN_LEAVE", "1.5")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            resolve()
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name", INTEGER_ENV)
@pytest.mark.parametrize("bad", ["x", "1.5", "-1", "8k"])
def test_integer_variables_name_themselves_when_refused(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    expected = "an integer >= 1" if name == "KOG_ATTN_BLOCK_T" else "a non-negative integer"
    with pytest.raises(ValueError, match=f"^{name}: must be {expected}, got {re.escape(repr(bad))}$"):
        resolve()


def test_integer_variables_read_whole_numbers(monkeypatch):
    for name in INTEGER_ENV:
        monkeypatch.setenv(name, "0")
    with pytest.raises(ValueError, match=r"KOG_ATTN_BLOCK_T: must be an integer >= 1, got '0'"):
        resolve()  # a key block of no keys: no "kernel's choice" there
    monkeypatch.setenv("KOG_ATTN_BLOCK_T", "32")
    settings = resolve()
    attention = settings.attention
    assert attention.splits is None and attention.num_warps is None  # 0: the kernel's choice
    assert attention.block_t == 32 and set(settings.head_blocks.values()) == {None}
    monkeypatch.setenv("KOG_ATTN_BLOCK_T", "")  # empty: unset
    assert resolve().attention.block_t == 64
    monkeypatch.setenv("KOG_ATTN_WARPS", " 8")
    assert resolve().attention.num_warps == 8
    assert env_count("KOG_UNSET_FOR_THIS_TEST", 7) == 7


@pytest.mark.parametrize(
    "device,attention,what",
    [(CPU, {"cluster": 1}, "cluster: thread-block clusters need a Hopper GPU"),
     (META, {"cluster": 1}, "cluster: thread-block clusters need a Hopper GPU"),
     (CPU, {"push": 1}, "push: the push merge runs in thread-block clusters"),
     (H200, {"cluster": 0, "push": 1}, "push: the push merge runs in thread-block clusters"),
     (CPU, {"prefetch_next": 1}, "prefetch_next: the L2 prefetch needs a Hopper GPU"),
     (H200, {"warps": 2}, "attention:"), (H200, {"cluster": 2}, "attention:")],
)  # fmt: skip
def test_attention_settings_the_device_cannot_run_are_refused(device, attention, what):
    with pytest.raises(ValueError, match=what):
        resolve(device, attention=attention)


def test_attention_switches_on_a_hopper_gpu(monkeypatch):
    switches = {"cluster": 1, "push": 1, "prefetch_next": 0, "kv_evict_first": 0}
    attention = resolve(H200, attention=switches).attention
    assert attention.cluster and attention.push
    assert not attention.prefetch_next and not attention.kv_evict_first
    assert resolve(H200, attention={"push": 1}).attention.push  # cluster unset: the kernel's choice, clusters
    monkeypatch.setenv("KOG_ATTN_PUSH", "1")
    with pytest.raises(ValueError, match="push: the push merge"):
        resolve(CPU)
    monkeypatch.setenv("KOG_ATTN_PUSH", "2")
    with pytest.raises(ValueError, match="KOG_ATTN_"):
        resolve(H200)


@pytest.mark.parametrize(
    "arguments,what",
    [({"head_blocks": {"rows": 2}}, "head_blocks:"), ({"prefetch": {"head": 2}}, "prefetch:"),
     ({"row_blocks": {"o": 2}}, "row_blocks:"), ({"blocks": {"down": {"block_n": -1}}}, "blocks.down:"),
     ({"lane_groups": {"streams": 2}}, "lane_groups:"), ({"early": {"o": 2}}, "early:")],
)  # fmt: skip
def test_unknown_arguments_are_refused(arguments, what):
    with pytest.raises(ValueError, match=what):
        resolve(**arguments)


@pytest.mark.parametrize("bad", ["128,x", "128,64,8,3,2", "-1", "1.5"])
def test_the_prefill_blocks_name_their_variable_when_refused(monkeypatch, bad):
    monkeypatch.setenv("KOG_PREFILL_ATTN", bad)
    with pytest.raises(ValueError, match=r"^KOG_PREFILL_ATTN: expected up to 4 non-negative integers \("):
        resolve()


def test_packing_is_the_default_for_one_lane_bf16_models_on_a_gpu(monkeypatch):
    assert resolve(H200).packed
    assert not resolve(H200, lanes=8).packed  # a Laneformer's o-proj and down-proj reduce across its lanes
    assert not resolve(H200, bf16=False).packed  # fp32 weights are not bf16 numbers in general
    assert not resolve(CPU).packed and not resolve(META).packed
    assert resolve(CPU, packed=True).packed  # the interpreter's sums stand in for the mma
    monkeypatch.setenv("KOG_PACKED", "0")
    assert not resolve(H200).packed
    assert resolve(H200, packed=True).packed  # the argument over the environment
    monkeypatch.setenv("KOG_PACKED", "1")
    assert resolve(CPU).packed
    monkeypatch.setenv("KOG_PACKED", "yes")
    with pytest.raises(ValueError, match="KOG_PACKED: expected"):
        resolve(H200)
    monkeypatch.setenv("KOG_PACKED", "o")
    assert resolve(H200).packed == {"o"}
    monkeypatch.delenv("KOG_PACKED")
    assert resolve(H200).packed == {"o", "down"}
    assert resolve(CPU, packed="down+o").packed == {"o", "down"}
    assert resolve(H200, packed="o+gate_up+down").packed == {"o", "gate_up", "down"}
    # a gate/up of PACKED_GATE_UP_MIN_BYTES or more is packed by default too, and with packed=True or KOG_PACKED=1
    # (gate and up rows as one [N, K] bf16 matrix)
    large = (PACKED_GATE_UP_MIN_BYTES // 2 // 2048, 2048)
    assert resolve(H200, gate_up_shape=large).packed == {"o", "gate_up", "down"}
    assert resolve(H200, gate_up_shape=(large[0] - 1, 2048)).packed == {"o", "down"}
    assert resolve(CPU, packed=True, gate_up_shape=large).packed == {"o", "gate_up", "down"}
    assert resolve(H200, packed="o+down", gate_up_shape=large).packed == {"o", "down"}
    with pytest.raises(ValueError, match="packed: a packed gate_up needs o and down"):
        resolve(H200, packed="gate_up+down")  # the o-proj clears the gate/up's sums
    assert resolve(H200, packed="o+qkv").packed == {"o", "qkv"}
    with pytest.raises(ValueError, match="packed: a packed qkv needs o"):
        resolve(H200, packed="qkv+down")  # the o-proj clears the q|k|v's sums
    with pytest.raises(ValueError, match="packed: expected"):
        resolve(H200, packed="o+head")
    with pytest.raises(ValueError, match="one-lane"):
        resolve(H200, lanes=8, packed=True)


def test_packed_blocks_from_the_environment_then_the_argument(monkeypatch):
    assert resolve(H200).packed_blocks == PACKED_DEFAULTS
    monkeypatch.setenv(
        "KOG_PACKED_BLOCKS", "o=1/8/4/0, down=0/16/0/2"
    )  # 0: the default's (or the launcher's) choice
    want = {**PACKED_DEFAULTS, "o": {"block_m": 1, "split": 8, "ahead": 4},
            "down": {**PACKED_DEFAULTS["down"], "split": 16, "items": 2}}  # fmt: skip
    assert resolve(H200).packed_blocks == want
    got = resolve(H200, packed_blocks={"down": {"ahead": 3}}).packed_blocks
    assert got == {**want, "down": {"ahead": 3}}
    for bad in ("head=1/8/4/1", "o=1/8/4", "o=a/8/4/1", "glu=2/0/16/0/4/1", "o=1/8/4/0/2"):
        monkeypatch.setenv("KOG_PACKED_BLOCKS", bad)
        with pytest.raises(ValueError, match="KOG_PACKED_BLOCKS"):
            resolve(H200)
    # the glu kind's fifth field: the chunks of `ahead` it loads before its wait
    monkeypatch.setenv("KOG_PACKED_BLOCKS", "glu=1/0/16/0/4")
    assert resolve(H200).packed_blocks["glu"] == {"block_m": 1, "ahead": 16, "before": 4}
    monkeypatch.delenv("KOG_PACKED_BLOCKS")
    with pytest.raises(ValueError, match="packed_blocks"):
        resolve(H200, packed_blocks={"o": {"block_n": 2}})


def test_a_gate_up_of_a_measured_shape_takes_its_own_blocks():
    """PACKED_SHAPE_DEFAULTS: qwen3-1.7b's gate/up shape over the kind's defaults, an override over both; other
    shapes (llama-3.2-1b's) keep the kind's."""
    qwen3, llama = (2 * 6144, 2048), (2 * 8192, 2048)
    assert PACKED_SHAPE_DEFAULTS[("gate_up", *qwen3)] == {"ahead": 1, "items": 2}
    assert resolve(H200, gate_up_shape=qwen3).packed_blocks == {**PACKED_DEFAULTS,
                                                                  "gate_up": {"ahead": 1, "items": 2}}  # fmt: skip
    assert resolve(H200, gate_up_shape=llama).packed_blocks == PACKED_DEFAULTS
    got = resolve(
        H200, gate_up_shape=qwen3, packed_blocks={"gate_up": {"ahead": 3, "split": 4}}
    ).packed_blocks
    assert got["gate_up"] == {"ahead": 3, "items": 2, "split": 4}


def test_a_gpu_runner_times_its_residual_at_several_addresses(monkeypatch):
    """inference/fast/residual_placement.py: RESIDUAL_CANDIDATES on a GPU, none elsewhere; the environment, then
    the argument over it; fewer than one refused by name."""
    assert RESIDUAL_CANDIDATES > 1
    assert resolve(H200).residual_candidates == RESIDUAL_CANDIDATES
    assert resolve(CPU).residual_candidates == resolve(META).residual_candidates == 1
    monkeypatch.setenv("KOG_RESIDUAL_CANDIDATES", "3")
    assert resolve(H200).residual_candidates == resolve(CPU).residual_candidates == 3
    assert resolve(H200, residual_candidates=1).residual_candidates == 1
    monkeypatch.setenv("KOG_RESIDUAL_CANDIDATES", "0")
    with pytest.raises(ValueError, match="^KOG_RESIDUAL_CANDIDATES: must be an integer >= 1, got '0'$"):
        resolve(H200)
    monkeypatch.delenv("KOG_RESIDUAL_CANDIDATES")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="^residual_candidates: expected an integer >= 1"):
            resolve(H200, residual_candidates=bad)
