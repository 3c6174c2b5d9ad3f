"""Two kernels' programs in one launch (kernels/pairing.py) give, bit for bit, what the two launches give alone."""

import pytest
import torch
from kernel_testing import DEVICE, ON_GPU, dtype_params, randn

from kernels.decode_attention import AttentionScratch, decode_attention_launch
from kernels.lane_reduce_gemv import lane_reduce_gemv_launch
from kernels.pairing import run_paired
from kernels.rmsnorm_gemv import rmsnorm_gemv_launch

LANES, DIM, FFN, HEADS, KV, HD, POS, MAX_LEN = 2, 64, 96, 4, 2, 16, 37, 48


def make_buffers(dtype: torch.dtype, seed: int) -> dict:
    """One group of lanes' decode buffers and weights, filled at random."""
    gen = torch.Generator().manual_seed(seed)
    qkv_rows = (HEADS + 2 * KV) // LANES * HD

    def rand(*shape, dtype=dtype, scale=1.0):
        return randn(*shape, dtype=dtype, scale=scale, gen=gen)

    return {
        "x": rand(LANES, DIM, dtype=torch.float32),
        "norm": rand(DIM).abs() + 0.5,
        "w1": rand(LANES, FFN, DIM, scale=0.2),
        "w3": rand(LANES, FFN, DIM, scale=0.2),
        "h": torch.zeros(LANES, FFN, dtype=dtype, device=DEVICE),
        "w2": rand(LANES, DIM, FFN, scale=0.2),
        "wqkv": rand(LANES, qkv_rows, DIM, scale=0.2),
        "qkv": rand(LANES, qkv_rows, scale=2.0),
        "k_cache": rand(KV, MAX_LEN, HD),
        "v_cache": rand(KV, MAX_LEN, HD),
        "attn": torch.zeros(LANES, HEADS // LANES * HD, dtype=dtype, device=DEVICE),
        "scratch": AttentionScratch(KV, HEADS // KV, HD, 4, DEVICE),
    }


def launches(b: dict, kind: str, cluster: bool = False):
    """The launch of one kind over buffers b (no PDL: the tests run each launch on its own)."""
    if kind == "gate_up":
        return rmsnorm_gemv_launch(b["x"], b["w1"], b["h"], norm_weight=b["norm"], weight_up=b["w3"])
    if kind == "qkv":
        return rmsnorm_gemv_launch(b["x"], b["wqkv"], b["qkv"], norm_weight=b["norm"])
    if kind == "down":
        return lane_reduce_gemv_launch(b["h"], b["w2"], b["x"], mode="scaled")
    angles = torch.rand(MAX_LEN, HD // 2, generator=torch.Generator().manual_seed(1)) * 6.3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    pos = torch.tensor([POS], dtype=torch.int32, device=DEVICE)
    return decode_attention_launch(b["qkv"], b["k_cache"], b["v_cache"], pos, cos, sin, b["attn"], b["scratch"],
                                   num_heads=HEADS, block_t=16, cluster=cluster, num_warps=4)  # fmt: skip


def clone(b: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()}


CASES = [(first, second, False) for first, second in
         [("attention", "gate_up"), ("attention", "down"), ("qkv", "down"), ("gate_up", "qkv")]]  # fmt: skip
if ON_GPU:  # the attention's clusters (sm_90) beside another kernel's programs
    CASES += [pytest.param("attention", "gate_up", True, marks=pytest.mark.gpu, id="attention-cluster-gate_up"),
              pytest.param("attention", "down", True, marks=pytest.mark.gpu, id="attention-cluster-down")]  # fmt: skip


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("first,second,cluster", CASES)
def test_paired_launch_equals_the_two_launches(dtype, first, second, cluster):
    # two independent groups of buffers (as two lane groups are); the pair must touch exactly what each alone does
    alone = [make_buffers(dtype, seed=3), make_buffers(dtype, seed=4)]
    paired = [clone(b) for b in alone]
    launches(alone[0], first, cluster).run()
    launches(alone[1], second).run()
    run_paired(launches(paired[0], first, cluster), launches(paired[1], second))
    for a, p in zip(alone, paired, strict=True):
        for name, tensor in a.items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(tensor, p[name]), f"{first} + {second}: {name} differs"


def test_paired_launch_refuses_what_it_cannot_join():
    b = make_buffers(torch.float32, seed=5)
    gate_up, down = launches(b, "gate_up"), launches(b, "down")
    down.num_warps = 8
    with pytest.raises(ValueError, match="the same warps"):
        run_paired(gate_up, down)
    down.num_warps, down.cluster = gate_up.num_warps, 2
    with pytest.raises(ValueError, match="cannot use clusters"):
        run_paired(gate_up, down)
