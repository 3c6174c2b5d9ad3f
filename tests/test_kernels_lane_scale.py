# No `import triton` here: kernel_testing chooses the interpreter first.
import pytest
import torch
from kernel_testing import DEVICE, dtype_params, poisoned, randn

from inference.model import rms_norm
from kernels.lane_scale import lane_scale


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("lanes,T,D", [(8, 13, 24), (1, 1, 16), (2, 40, 96), (3, 5, 20)])
def test_lane_scale_is_the_eager_broadcast_bit_for_bit(dtype, lanes, T, D):
    # the first norm of the prefill, both ways: the eager reference's broadcast and the kernel over the one
    # normed sequence (D = 20: a row that is not a multiple of the 16-byte vectors)
    gen = torch.Generator().manual_seed(T)
    x = randn(1, T, D, dtype=dtype, scale=3.0, gen=gen)
    scale = randn(lanes, D, dtype=dtype, gen=gen) + 1.0
    want = rms_norm(x, scale[:, None], 1e-5)  # [L, T, D]
    normed = rms_norm(x, torch.ones(D, dtype=dtype, device=DEVICE), 1e-5)[0]  # ones: the norm alone, [T, D]
    out = lane_scale(normed, scale, out=poisoned(lanes, T, D, dtype=dtype))
    assert torch.equal(out, want)


def test_lane_scale_rejects_bad_input():
    normed, scale = randn(4, 8), randn(2, 8)
    with pytest.raises(ValueError, match="normed:"):
        lane_scale(normed.t(), scale)
    with pytest.raises(ValueError, match="scale:"):
        lane_scale(normed, randn(2, 6))
    with pytest.raises(ValueError, match="scale:"):
        lane_scale(normed, scale.half())
    with pytest.raises(ValueError, match="out:"):
        lane_scale(normed, scale, out=randn(2, 4, 7))
    assert lane_scale(randn(0, 8), scale).shape == (2, 0, 8)
