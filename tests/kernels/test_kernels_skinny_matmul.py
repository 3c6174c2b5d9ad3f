import pytest
import torch
import torch.nn.functional as F

from kernels.skinny_matmul import MAX_ROWS, skinny_glu, skinny_linear
from tests.support.kernels import DEVICE, assert_close, dtype_params, poisoned, randn


def reference(x, w1, w3):
    """fp64 on the same inputs: silu(x w1^T) * (x w3^T)."""
    x64 = x.double().cpu()
    return F.silu(x64 @ w1.double().cpu().mT) * (x64 @ w3.double().cpu().mT)


# (lanes, rows, N, K): one row and a full 16-row block; 9 rows (k = 8 drafts) with N and K not multiples of the
# blocks; 17 and 32 rows (the 32-row block); one lane, as a one-lane model's
SHAPES = [(2, 1, 48, 64), (3, 9, 40, 72), (2, 16, 64, 128), (2, 17, 33, 96), (1, 32, 64, 160)]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("glu", [True, False], ids=["skinny_glu", "skinny_linear"])
def test_skinny_products_match_the_reference(dtype, shape, glu):
    lanes, rows, n, k = shape
    gen = torch.Generator().manual_seed(rows * 31 + n)
    x = randn(lanes, rows, k, dtype=dtype, gen=gen)
    w1, w3 = (randn(lanes, n, k, dtype=dtype, scale=k**-0.5, gen=gen) for _ in range(2))
    out = poisoned(lanes, rows, n, dtype=dtype)
    if glu:
        assert skinny_glu(x, w1, w3, out=out, block_n=16, block_k=32) is out
        assert_close(out, reference(x, w1, w3), dtype)
    else:
        assert skinny_linear(x, w1, out=out, block_n=16, block_k=32) is out
        assert_close(out, x.double().cpu() @ w1.double().cpu().mT, dtype)


@pytest.mark.parametrize("dtype", dtype_params())
def test_skinny_glu_rounds_as_the_prefills_two_products_and_silu_mul(dtype):
    """The same as silu_mul over the two products' rounded outputs, up to the products' summation order: in half
    precision most elements are the same number (both sum in fp32 and round the same way), the rest a unit in
    the last place apart; in fp32 the summation order shows in the last bits."""
    gen = torch.Generator().manual_seed(5)
    x = randn(2, 9, 64, dtype=dtype, gen=gen)
    w1, w3 = (randn(2, 48, 64, dtype=dtype, scale=0.125, gen=gen) for _ in range(2))
    separate = F.silu(torch.bmm(x, w1.mT)) * torch.bmm(x, w3.mT)
    fused = skinny_glu(x, w1, w3, block_n=16, block_k=64)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-6)
    else:
        same = (fused == separate).float().mean().item()
        assert same >= 0.9, f"only {same:.1%} of the elements equal"
        torch.testing.assert_close(fused, separate, rtol=2 * torch.finfo(dtype).eps, atol=1e-4)


@pytest.mark.parametrize("dtype", dtype_params())
def test_skinny_glu_reads_a_lane_broadcast_x(dtype):
    """x of stride 0 over the lanes (one block of rows shared by every lane) gives each lane its own product."""
    gen = torch.Generator().manual_seed(7)
    shared = randn(1, 5, 64, dtype=dtype, gen=gen).expand(4, 5, 64)
    w1, w3 = (randn(4, 32, 64, dtype=dtype, scale=0.125, gen=gen) for _ in range(2))
    out = skinny_glu(shared, w1, w3, block_n=16)
    assert_close(out, reference(shared, w1, w3), dtype)
    assert not torch.equal(out[0], out[1])


def test_skinny_glu_refuses_what_it_cannot_take():
    x, w = torch.zeros(2, 3, 64, device=DEVICE), torch.zeros(2, 16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        skinny_glu(torch.zeros(2, MAX_ROWS + 1, 64, device=DEVICE), w, w)
    with pytest.raises(ValueError, match="w1"):
        skinny_glu(x, torch.zeros(3, 16, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="w3"):
        skinny_glu(x, w, torch.zeros(2, 8, 64, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        skinny_glu(x, w, w, out=torch.zeros(2, 3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="w: expected"):
        skinny_linear(x, torch.zeros(2, 16, 32, device=DEVICE))
