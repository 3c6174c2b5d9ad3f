import pytest
import torch
from kernel_testing import DEVICE, ON_GPU, assert_close, dtype_params, randn

from kernels.fused_mlp import fused_mlp
from kernels.lane_reduce_gemv import lane_reduce_gemv
from kernels.rmsnorm_gemv import rmsnorm_gemv


def reference(x, g, w1, w3, w2t, eps):
    """fp64: x + W2 @ (silu(W1 @ hn) * (W3 @ hn)), hn = rmsnorm(x) * g, h rounded to the weights' dtype as the
    two-launch path stores it."""
    x64 = x.double().cpu()[0]
    hn = x64 * torch.rsqrt(x64.pow(2).mean() + eps) * g.double().cpu().view(-1)
    h = torch.nn.functional.silu(w1.double().cpu()[0] @ hn) * (w3.double().cpu()[0] @ hn)
    h = h.to(w1.dtype).double()
    return (x64 + w2t.double().cpu()[0].t() @ h).view(1, -1)


def inputs(n: int, k: int, dtype: torch.dtype):
    """x [1, K] fp32, g [K], w1 / w3 / w2t [1, N, K] and a zeroed out [1, K]."""
    return (randn(1, k, scale=3.0), randn(k, dtype=dtype).abs() + 0.5, randn(1, n, k, dtype=dtype, scale=k**-0.5),
            randn(1, n, k, dtype=dtype, scale=k**-0.5), randn(1, n, k, dtype=dtype, scale=n**-0.5),
            torch.zeros(1, k, device=DEVICE))  # fmt: skip


# (rows N, K): odd rows and a K that is not a multiple of the tile, and round ones
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("n,k", [(37, 40), (64, 96), (130, 128)])
# the launcher's choice, and small blocks whose last row block of a program is partial or empty
@pytest.mark.parametrize("block_n,block_k,row_blocks", [(None, None, None), (4, 32, 3), (2, 64, 5)])
@pytest.mark.parametrize("prefetch", [1, 64])  # W1 / W3 tiles before the wait: one, all
def test_fused_mlp_matches_reference(dtype, n, k, block_n, block_k, row_blocks, prefetch):
    x, g, w1, w3, w2t, out = inputs(n, k, dtype)
    fused_mlp(x, g, w1, w3, w2t, out, eps=1e-5, block_n=block_n, block_k=block_k, row_blocks=row_blocks,
              prefetch=prefetch)  # fmt: skip
    assert_close(out, reference(x, g, w1, w3, w2t, 1e-5), dtype)


@pytest.mark.parametrize("dtype", dtype_params())
def test_fused_mlp_equals_the_two_launches(dtype):
    # the runner's other path: rmsnorm_gemv's gate/up (h stored in the weights' dtype), then the down-proj
    n, k = 96, 64
    x, g, w1, w3, w2t, out = inputs(n, k, dtype)
    h = torch.empty(1, n, dtype=dtype, device=DEVICE)
    rmsnorm_gemv(x, w1, h, norm_weight=g, weight_up=w3)
    two = x.clone()
    lane_reduce_gemv(h, w2t.transpose(1, 2).contiguous(), two)
    fused_mlp(x, g, w1, w3, w2t, out, use_pdl=ON_GPU, trigger_early=True)
    assert_close(out, two, dtype)


def test_zeroed_by_the_o_proj():
    # lane_reduce_gemv's `zero`: the o-proj clears the buffer the fused MLP then adds into
    act, w = randn(1, 32), randn(1, 24, 32, scale=0.2)
    x, stale = randn(1, 24), randn(1, 24)
    lane_reduce_gemv(act, w, x, zero=stale)
    assert torch.equal(stale, torch.zeros_like(stale))
    with pytest.raises(ValueError, match="zero:"):
        lane_reduce_gemv(act, w, x, zero=x)
    with pytest.raises(ValueError, match="zero:"):
        lane_reduce_gemv(act, w, x, zero=randn(1, 23))


def test_rejects_bad_arguments():
    x, g, w1, w3, w2t, out = inputs(16, 32, torch.float32)
    with pytest.raises(ValueError, match="w1:"):
        fused_mlp(x, g, w1.expand(2, -1, -1), w3, w2t, out)
    with pytest.raises(ValueError, match="w2t:"):
        fused_mlp(x, g, w1, w3, w2t[:, :8], out)
    with pytest.raises(ValueError, match="w3, w2t:"):
        fused_mlp(x, g, w1, w3.half(), w2t, out)
    with pytest.raises(ValueError, match="x:"):
        fused_mlp(x.half(), g, w1, w3, w2t, out)
    with pytest.raises(ValueError, match="out:"):
        fused_mlp(x, g, w1, w3, w2t, x)
    with pytest.raises(ValueError, match="norm_weight:"):
        fused_mlp(x, g[:8], w1, w3, w2t, out)
    with pytest.raises(ValueError, match="prefetch:"):
        fused_mlp(x, g, w1, w3, w2t, out, prefetch=0)
