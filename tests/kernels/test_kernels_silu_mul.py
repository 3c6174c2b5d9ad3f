# No `import triton` here: it must come after kernel_testing has chosen the interpreter (a triton imported
# first keeps its library functions compiled-only, and every later interpreted kernel in the run fails).
import pytest
import torch
import torch.nn.functional as F

from kernels.silu_mul import _silu_mul_kernel, silu_mul
from tests.support.kernels import DEVICE, assert_close, dtype_params, poisoned, randn

# The interpreter's exp (numpy) warns when exp(-gate) overflows to inf, as it does on purpose for gate << 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def reference(gate, up):
    """fp64 on the same (rounded) inputs: the exact product, for assert_close's relative error."""
    g, u = gate.double().cpu(), up.double().cpu()
    return F.silu(g) * u


def with_extremes(gate: torch.Tensor) -> torch.Tensor:
    """gate with large negative and positive values and zeros spread over it (and in its tail)."""
    flat = gate.view(-1)
    extremes = torch.tensor([-1e4, -100.0, -30.0, 0.0, 30.0, 100.0, 0.0, -0.0], dtype=gate.dtype)
    idx = torch.arange(0, flat.numel(), 7)
    flat[idx] = extremes.repeat(idx.numel() // extremes.numel() + 1)[: idx.numel()].to(gate.device)
    flat[-1] = -1e4
    return gate


# Any rank, flattened: a tail shorter than a block (105), a rank-1 tensor of a few blocks plus a tail at
# block=64, an [L, T, F/L] prefill shape, a single element.
SHAPES = [(3, 5, 7), (3 * 64 + 37,), (4, 33, 48), (1,), (2, 9)]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [None, 64])
def test_silu_mul_matches_reference(dtype, shape, block):
    gen = torch.Generator().manual_seed(0)
    gate = with_extremes(randn(*shape, dtype=dtype, scale=3.0, gen=gen))
    up = randn(*shape, dtype=dtype, gen=gen)
    up.view(-1)[::5] = 0.0
    out = silu_mul(gate, up, block=block)
    assert out.shape == gate.shape and out.dtype == dtype and out.device == gate.device
    assert_close(out, reference(gate, up), dtype)


@pytest.mark.parametrize("dtype", dtype_params())
def test_silu_mul_rounds_as_eager(dtype):
    """The same two roundings as `F.silu(gate) * up` in the dtype: in fp16/bf16 equal bit for bit but for the
    odd element whose exponential differs in its last fp32 bit (rounding once instead would differ on ~25%
    of them), and nowhere more than a unit in the last place; in fp32 (no inner rounding to reproduce) within
    a few units of eager's, whose exponential is another fp32 approximation."""
    gen = torch.Generator().manual_seed(1)
    gate = with_extremes(randn(8, 61, 96, dtype=dtype, scale=3.0, gen=gen))
    up = randn(8, 61, 96, dtype=dtype, gen=gen)
    want = F.silu(gate) * up
    out = silu_mul(gate, up)
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=4 * eps, atol=tiny)
        return
    same = (out == want).float().mean().item()
    assert same >= 0.999, f"only {same:.2%} of the elements equal eager's"
    torch.testing.assert_close(out, want, rtol=eps, atol=tiny)


@pytest.mark.parametrize("dtype", dtype_params())
def test_silu_mul_out_given_or_allocated(dtype):
    gate, up = randn(3, 100, dtype=dtype, scale=3.0), randn(3, 100, dtype=dtype)
    allocated = silu_mul(gate, up)
    buffer = poisoned(3, 100, dtype=dtype)
    assert silu_mul(gate, up, buffer) is buffer
    assert torch.equal(buffer, allocated)
    # in place, as the prefill uses it: out is gate (or up) itself
    want = allocated.clone()
    assert silu_mul(gate, up, out=gate) is gate
    assert torch.equal(gate, want)
    gate2 = randn(3, 100, dtype=dtype, scale=3.0)
    want2 = silu_mul(gate2, up)
    assert silu_mul(gate2, up, out=up) is up
    assert torch.equal(up, want2)


def test_silu_mul_empty():
    gate = torch.empty(0, 5, device=DEVICE)
    assert silu_mul(gate, gate.clone()).shape == (0, 5)


def test_silu_mul_int64_offsets():
    """The 64-bit offset path (taken from 2**31 elements on, too large to test) computes the same."""
    gate, up = randn(3 * 64 + 37, scale=3.0), randn(3 * 64 + 37)
    out = poisoned(3 * 64 + 37, dtype=torch.float32)
    _silu_mul_kernel[(-(-gate.numel() // 64),)](gate, up, out, gate.numel(), BLOCK=64, INT64=True)
    assert_close(out, reference(gate, up), torch.float32)


def test_silu_mul_names_bad_arguments():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="up: expected gate's shape"):
        silu_mul(x, torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="up: expected gate's dtype"):
        silu_mul(x, torch.zeros(4, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="up: expected gate's device"):
        silu_mul(x, torch.zeros(4, 8, device="meta"))
    with pytest.raises(ValueError, match="out: expected gate's shape"):
        silu_mul(x, x.clone(), torch.zeros(32, device=DEVICE))
    with pytest.raises(ValueError, match="out: expected gate's dtype"):
        silu_mul(x, x.clone(), torch.zeros(4, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="out: expected gate's device"):
        silu_mul(x, x.clone(), torch.zeros(4, 8, device="meta"))
    with pytest.raises(ValueError, match="gate: expected a contiguous"):
        silu_mul(torch.zeros(8, 4, device=DEVICE).t(), x.clone())
    with pytest.raises(ValueError, match="up: expected a contiguous"):
        silu_mul(x, torch.zeros(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        silu_mul(x, x.clone(), torch.zeros(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="gate: expected fp32"):
        silu_mul(x.long(), x.long())
    with pytest.raises(ValueError, match="partly overlap"):
        big = torch.zeros(2, 4, 8, device=DEVICE)
        silu_mul(big[0], x, big.view(-1)[1:33].view(4, 8))
    with pytest.raises(ValueError, match="block"):
        silu_mul(x, x.clone(), block=48)
