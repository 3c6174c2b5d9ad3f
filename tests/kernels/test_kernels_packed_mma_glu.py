"""kernels/packed_mma_glu.py: the gate/up from the interleaved 12-bit layout, SiLU and RMSNorm in the launch, is
the reference MLP's h (the interpreter's sums in the mma's place on the CPU; the mma on a GPU)."""

import pytest
import torch
from test_kernels_packed_gemv import awkward_matrix

from kernels.packed_mma_gemv import move, pack_mma, packed_mma_gemv
from kernels.packed_mma_glu import interleave_glu, packed_mma_glu
from tests.support.kernels import DEVICE, ON_GPU, assert_close, randn


def reference_h(gate: torch.Tensor, up: torch.Tensor, x: torch.Tensor, g: torch.Tensor, eps: float):
    """fp64 on the CPU: silu(W_gate @ n) * (W_up @ n), n = rmsnorm(x) * g."""
    xd = x.double().cpu()
    normed = xd * torch.rsqrt(xd.pow(2).mean() + eps) * g.double().cpu()
    return torch.nn.functional.silu(gate.double() @ normed) * (up.double() @ normed)


def glu_inputs(f: int, k: int, seed: int):
    gate = awkward_matrix(f, k, seed=seed)  # exceptions, zero rows, an outlier: in the gate's tiles
    up = awkward_matrix(f, k, seed=seed + 1)
    up[f - 1, :3] = 2e-9  # and in an up row of the last tile
    x = randn(k, scale=3.0)
    g = (randn(k).abs() + 0.5).to(torch.bfloat16)
    return gate, up, x, g


def test_interleaving_puts_eight_gate_rows_then_their_up_rows_in_each_tile():
    gate = torch.arange(16 * 3).view(16, 3).float()
    up = -gate
    both = interleave_glu(gate, up)
    assert torch.equal(both[0:8], gate[0:8]) and torch.equal(both[8:16], up[0:8])
    assert torch.equal(both[16:24], gate[8:16]) and torch.equal(both[24:32], up[8:16])
    with pytest.raises(ValueError, match="multiple of 8"):
        interleave_glu(gate[:12], up[:12])


@pytest.mark.parametrize("f,k", [(8, 64), (24, 192), (64, 2048)])
@pytest.mark.parametrize(
    "block_m,ahead,before,x_ahead", [(1, 4, None, 4), (1, 1, 0, 1), (2, 8, 3, 2), (4, 2, None, 8)]
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_h_is_the_reference_mlps(f, k, block_m, ahead, before, x_ahead, out_dtype):
    if (f // 8) % block_m:
        pytest.skip("block_m must divide the M-tiles")
    gate, up, x, g = glu_inputs(f, k, seed=11)
    out = torch.full((f,), 7.0, device=DEVICE, dtype=out_dtype)
    packed = move(pack_mma(interleave_glu(gate, up)), DEVICE)
    assert packed.exceptions > 40  # the awkward rows', in both halves
    packed_mma_glu(x, g, packed, out, eps=1e-5, block_m=block_m, ahead=ahead, before=before, x_ahead=x_ahead)
    want = reference_h(gate, up, x, g, 1e-5)
    if out_dtype == torch.bfloat16:  # rounded once, from fp32 sums: within a bf16 step of the exact value
        assert_close(out.float(), want, torch.bfloat16)
        assert torch.equal(out.float().cpu(), out.float().cpu().to(torch.bfloat16).float())
    else:
        assert_close(out, want, torch.float32)


def test_an_exception_goes_into_its_own_rows_sum():
    """x nonzero at the exceptions' columns only: without their correction each row would add its floor, and one
    put in the wrong row (gate for up, or another lane's) would show in h."""
    f, k = 16, 128
    gen = torch.Generator().manual_seed(3)
    gate = torch.randn(f, k, generator=gen) * k**-0.5
    up = torch.randn(f, k, generator=gen) * k**-0.5
    gate[5, 7], up[5, 130 % k], up[12, 7], gate[15, 100] = 3e-9, -2e-10, 1e-8, 5e-9
    gate, up = gate.to(torch.bfloat16), up.to(torch.bfloat16)
    # a small background so that every row's sum is not zero, and large values at the exceptions' columns
    x = torch.full((k,), 1e-3)
    x[[7, 2, 100]] = torch.tensor([1e6, -3e6, 2e6])
    g = torch.ones(k, dtype=torch.bfloat16)
    packed = pack_mma(interleave_glu(gate, up))
    assert packed.exceptions >= 4
    out = torch.zeros(f, device=DEVICE)
    packed_mma_glu(x.to(DEVICE), g.to(DEVICE), move(packed, DEVICE), out, eps=1e-6)
    assert_close(out, reference_h(gate, up, x, g, 1e-6), torch.float32)


def test_then_the_packed_down_proj_is_the_reference_mlp():
    """gate/up then the down-proj as the runner chains them: x + W2 @ h."""
    d, f = 128, 192
    gate, up, x, g = glu_inputs(f, d, seed=21)
    w2 = awkward_matrix(d, f, seed=9)
    h = torch.zeros(f, device=DEVICE, dtype=torch.bfloat16)
    packed_mma_glu(x, g, move(pack_mma(interleave_glu(gate, up)), DEVICE), h, eps=1e-6)
    out = x.clone()
    packed_mma_gemv(h.float(), move(pack_mma(w2), DEVICE), out)  # fp32 of bf16 values: the interpreter's too
    assert_close(out - x, w2.double() @ reference_h(gate, up, x, g, 1e-6), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the mma runs on a GPU")
@pytest.mark.parametrize("block_m", [1, 2, 4])
def test_qwen3_shapes_on_the_tensor_cores(block_m):
    """qwen3-1.7b's gate/up (2 x 6144 x 2048) in bf16 with PDL and the early trigger."""
    gen = torch.Generator().manual_seed(4)
    f, k = 6144, 2048
    gate = (torch.randn(f, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    up = (torch.randn(f, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    x = randn(k, scale=3.0, gen=gen)
    g = (randn(k, gen=gen).abs() + 0.5).to(torch.bfloat16)
    out = torch.zeros(f, device=DEVICE, dtype=torch.bfloat16)
    packed = pack_mma(interleave_glu(gate, up).to(DEVICE))  # on the GPU: the host takes a minute
    packed_mma_glu(x, g, packed, out, block_m=block_m, ahead=12, use_pdl=True, trigger_early=True)
    assert_close(out.float(), reference_h(gate, up, x, g, 1e-6), torch.bfloat16)


def test_the_launcher_refuses_mismatched_arguments():
    gate, up, x, g = glu_inputs(16, 128, seed=1)
    packed = move(pack_mma(interleave_glu(gate, up)), DEVICE)
    out = torch.zeros(16, device=DEVICE)
    with pytest.raises(ValueError, match="x: expected"):
        packed_mma_glu(x.to(torch.bfloat16), g, packed, out)
    with pytest.raises(ValueError, match="norm_weight"):
        packed_mma_glu(x, g.float(), packed, out)
    with pytest.raises(ValueError, match="out: expected"):
        packed_mma_glu(x, g, packed, torch.zeros(32, device=DEVICE))
    with pytest.raises(ValueError, match="block_m"):
        packed_mma_glu(x, g, packed, out, block_m=3)
    with pytest.raises(ValueError, match="block_m"):
        packed_mma_glu(x, g, packed, out, block_m=4)  # 2 M-tiles
    with pytest.raises(ValueError, match="ahead"):
        packed_mma_glu(x, g, packed, out, ahead=0)
    with pytest.raises(ValueError, match="ahead"):
        packed_mma_glu(x, g, packed, out, x_ahead=0)
    with pytest.raises(ValueError, match="before"):
        packed_mma_glu(x, g, packed, out, before=-1)
