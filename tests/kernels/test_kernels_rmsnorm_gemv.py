import pytest
import torch

import kernels.rmsnorm_gemv as rmsnorm_module
from kernels.rmsnorm_gemv import rmsnorm_gemv
from tests.support.kernels import DEVICE, ON_GPU, assert_close, dtype_params, poisoned, randn


def reference(x, weight, norm_weight=None, eps=1e-6, weight_up=None, bias=None):
    """fp64: out[l] = W[l] @ (rmsnorm(x[l]) * g) (+ bias) or silu(W h) * (W_up h)."""
    x, weight = x.double().cpu(), weight.double().cpu()
    h = x
    if norm_weight is not None:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double().cpu()
    y = torch.einsum("lnk,lk->ln", weight, h.expand(weight.shape[0], -1))
    if bias is not None:
        y = y + bias.double().cpu()
    if weight_up is not None:
        y = torch.nn.functional.silu(y) * torch.einsum(
            "lnk,lk->ln", weight_up.double().cpu(), h.expand(weight.shape[0], -1)
        )
    return y


# (lanes, rows, K): odd rows and a K that is not a multiple of the tile, and round ones
SHAPES = [(1, 37, 40), (2, 24, 64), (3, 10, 200), (4, 64, 96)]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("lanes,n,k", SHAPES)
@pytest.mark.parametrize("block_n,block_k", [(None, None), (4, 32)])  # the launcher's choice, and small tiles
@pytest.mark.parametrize("prefetch", [1, 3, 64])  # weight tiles before the wait: one, some, all
@pytest.mark.parametrize("row_blocks", [1, 3])  # row blocks a program takes in turn (3: a partial last one)
def test_rmsnorm_gemv_matches_reference(dtype, lanes, n, k, block_n, block_k, prefetch, row_blocks):
    x = randn(lanes, k, scale=3.0)  # the residual stream is fp32
    w = randn(lanes, n, k, dtype=dtype, scale=k**-0.5)
    g = randn(lanes, k, dtype=dtype).abs() + 0.5
    out = poisoned(lanes, n, dtype=torch.float32)
    rmsnorm_gemv(x, w, out, norm_weight=g, eps=1e-5, block_n=block_n, block_k=block_k, prefetch=prefetch,
                 row_blocks=row_blocks)  # fmt: skip
    assert_close(out, reference(x, w, g, 1e-5), dtype)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("row_blocks", [1, 2])
def test_shared_norm_weight_and_bias_and_low_precision_out(dtype, row_blocks):
    lanes, n, k = 2, 33, 72
    x = randn(lanes, k)
    w = randn(lanes, n, k, dtype=dtype, scale=k**-0.5)
    g = randn(k, dtype=dtype)
    b = randn(lanes, n, dtype=dtype)
    out = poisoned(lanes, n, dtype=dtype)
    rmsnorm_gemv(x, w, out, norm_weight=g, bias=b, block_n=8, row_blocks=row_blocks)
    assert_close(out, reference(x, w, g, bias=b), dtype)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("lanes,n,k", [(1, 19, 48), (2, 16, 128)])
@pytest.mark.parametrize("prefetch,row_blocks", [(1, 1), (2, 2)])
def test_gated_silu(dtype, lanes, n, k, prefetch, row_blocks):
    x = randn(lanes, k, scale=2.0)
    w, w_up = randn(lanes, n, k, dtype=dtype, scale=k**-0.5), randn(lanes, n, k, dtype=dtype, scale=k**-0.5)
    g = randn(lanes, k, dtype=dtype)
    out = poisoned(lanes, n, dtype=torch.float32)
    rmsnorm_gemv(x, w, out, norm_weight=g, weight_up=w_up, block_n=8, block_k=32, prefetch=prefetch,
                 row_blocks=row_blocks)  # fmt: skip
    assert_close(out, reference(x, w, g, weight_up=w_up), dtype)


@pytest.mark.parametrize("dtype", dtype_params())
def test_triggering_the_next_kernel_early_changes_no_bit(dtype):
    # trigger_early moves griddepcontrol.launch_dependents before the first loads (PDL on a GPU; a no-op in the
    # interpreter, where the argument must still be taken)
    x, w, w_up = randn(1, 128, scale=2.0), randn(1, 40, 128, dtype=dtype), randn(1, 40, 128, dtype=dtype)
    outs = []
    for early in (False, True):
        out = poisoned(1, 40, dtype=torch.float32)
        rmsnorm_gemv(x, w, out, norm_weight=randn(128, dtype=dtype, gen=torch.Generator().manual_seed(1)),
                     weight_up=w_up, use_pdl=ON_GPU, trigger_early=early, prefetch=3)  # fmt: skip
        outs.append(out)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", dtype_params())
def test_input_row_chosen_by_token_on_device(dtype):
    lanes, n, k, vocab = 3, 20, 56, 11
    table = randn(vocab, k, dtype=dtype)
    w = randn(lanes, n, k, dtype=dtype, scale=k**-0.5)
    g = randn(lanes, k, dtype=dtype)
    token = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    out = poisoned(lanes, n, dtype=torch.float32)
    rmsnorm_gemv(table, w, out, norm_weight=g, token=token)
    assert_close(out, reference(table[7:8].float(), w, g), dtype)


def test_no_norm_and_explicit_blocks():
    x = randn(1, 100)
    w = randn(1, 45, 100, scale=0.1)
    out = poisoned(1, 45, dtype=torch.float32)
    rmsnorm_gemv(x, w, out, block_n=8, block_k=32, num_warps=2)
    assert_close(out, reference(x, w), torch.float32)


def test_rejects_mismatched_shapes():
    w = randn(2, 8, 16)
    with pytest.raises(ValueError, match="x:"):
        rmsnorm_gemv(randn(2, 15), w, torch.empty(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="out:"):
        rmsnorm_gemv(randn(2, 16), w, torch.empty(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight:"):
        rmsnorm_gemv(randn(2, 16), w, torch.empty(2, 8, device=DEVICE), norm_weight=randn(3, 16))
    with pytest.raises(ValueError, match="prefetch:"):
        rmsnorm_gemv(randn(2, 16), w, torch.empty(2, 8, device=DEVICE), prefetch=0)
    with pytest.raises(ValueError, match="row_blocks:"):
        rmsnorm_gemv(randn(2, 16), w, torch.empty(2, 8, device=DEVICE), row_blocks=0)


def test_launcher_picks_the_measured_blocks_on_a_gpu(monkeypatch):
    """The H200 sweeps' choices (docs/fast-path.md), as the launcher would make them on 132 SMs."""
    monkeypatch.setattr(rmsnorm_module, "interpreted", lambda: False)
    monkeypatch.setattr(rmsnorm_module, "sm_count", lambda device: 132)
    pick = rmsnorm_module._pick_blocks
    cpu = torch.device("cpu")
    assert pick(1, 3072, 2048, False, cpu) == (8, 1024, 8)  # llama-3.2-1b q|k|v
    assert pick(1, 4096, 2048, False, cpu) == (8, 1024, 8)  # qwen3-1.7b q|k|v
    assert pick(8, 640, 3072, False, cpu) == (8, 512, 4)  # laneformer-2b q|k|v (8 lanes)
    assert pick(1, 8192, 2048, True, cpu) == (4, 512, 4)  # llama-3.2-1b gate/up (halved by row blocks)
    assert pick(8, 1536, 3072, True, cpu) == (8, 512, 4)  # laneformer-2b gate/up
    rows = rmsnorm_module._pick_row_blocks
    assert rows(8192, 2048, True, cpu) == 4  # llama-3.2-1b gate/up: about 8 programs a multiprocessor
    assert rows(6144, 2048, True, cpu) == 3  # qwen3-1.7b gate/up
    assert rows(1536, 3072, True, cpu) == 1  # laneformer-2b gate/up (K 3072)
    assert rows(3072, 2048, False, cpu) == 1  # q|k|v rows
