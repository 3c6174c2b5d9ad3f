import pytest
import torch
from kernel_testing import DEVICE, ON_GPU, assert_close, attention_reference, dtype_params, poisoned, randn

from kernels.decode_attention import AttentionScratch
from kernels.qkv_attention import qkv_attention


def projection_reference(x, weight, norm_weight, eps, bias):
    """fp64 q|k|v [L, N]: W[l] @ (rmsnorm(x[l]) * g) (+ bias)."""
    x = x.double().cpu()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double().cpu()
    y = torch.einsum("lnk,lk->ln", weight.double().cpu(), h.expand(weight.shape[0], -1))
    return y if bias is None else y + bias.double().cpu()


def run_case(dtype, lanes, num_heads, num_kv, hd, k, pos, splits, *, fused, window=None, interleaved=True,
             qk_norm=False, with_bias=False, from_token=False, block_n=None, block_k=None, prefetch=1,
             max_len=None):  # fmt: skip
    max_len = max_len or pos + 8
    n = (num_heads + 2 * num_kv) // lanes * hd
    if from_token:  # layer 0: every lane reads row `token` of the embedding table
        table = randn(7, k, dtype=dtype, scale=2.0)
        token = torch.tensor([5], dtype=torch.int32, device=DEVICE)
        x, x_ref = table, table[5:6].expand(lanes, k)
    else:
        x = randn(lanes, k, scale=2.0)  # the residual stream is fp32
        token, x_ref = None, x
    weight = randn(lanes, n, k, dtype=dtype, scale=k**-0.5)
    norm_weight = randn(k, dtype=dtype).abs() + 0.5
    bias = randn(lanes, n, dtype=dtype) if with_bias else None
    k_cache, v_cache = randn(num_kv, max_len, hd, dtype=dtype), randn(num_kv, max_len, hd, dtype=dtype)
    start = 0 if window is None else max(0, pos - window + 1)
    for cache in (k_cache, v_cache):  # positions the kernel must not read are NaN
        cache[:, pos:] = float("nan")
        cache[:, :start] = float("nan")
    old_k, old_v = k_cache.clone(), v_cache.clone()
    angles = torch.rand(max_len, hd // 2, dtype=torch.float32) * 6.3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    q_norm = randn(hd, dtype=dtype).abs() + 0.5 if qk_norm else None
    k_norm = randn(hd, dtype=dtype).abs() + 0.5 if qk_norm else None
    qkv = poisoned(lanes, n, dtype=torch.float32)
    out = poisoned(lanes, num_heads // lanes * hd, dtype=torch.float32)
    scratch = AttentionScratch(num_kv, num_heads // num_kv, hd, splits, DEVICE)
    pos_t = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    qkv_attention(x, weight, qkv, k_cache, v_cache, pos_t, cos, sin, out, scratch, num_heads=num_heads,
                  norm_weight=norm_weight, bias=bias, token=token, window=window, interleaved=interleaved,
                  q_norm=q_norm, k_norm=k_norm, eps=1e-5, fused=fused, block_n=block_n, block_k=block_k,
                  prefetch=prefetch)  # fmt: skip

    # Every q|k|v row is projected (by whichever program of the head's cluster owns it) ...
    assert_close(qkv, projection_reference(x_ref, weight, norm_weight, 1e-5, bias), dtype, "qkv")
    # ... and attention reads exactly those rows (checked against the fp64 attention of the kernel's own q|k|v).
    want, want_k, want_v = attention_reference(qkv, old_k, old_v, pos, cos, sin, num_heads, window, interleaved,
                                               q_norm, k_norm, 1e-5)  # fmt: skip
    assert_close(out, want, dtype, "out")
    assert_close(k_cache[:, pos], want_k, dtype, "cached k")
    assert_close(v_cache[:, pos], want_v, dtype, "cached v")
    assert (scratch.counter == 0).all(), "split counters must return to zero for the next layer"


def fused_params():
    """One launch on a Hopper GPU; the interpreter runs the projection and the attention as two launches."""
    return [pytest.param(True, marks=pytest.mark.gpu), False] if ON_GPU else [False]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("fused", fused_params())
@pytest.mark.parametrize(
    "lanes,num_heads,num_kv,hd,k,pos,splits",
    [
        (1, 8, 2, 32, 64, 37, 4),  # GQA group 4 (Llama's layout): 48 group rows a program
        (1, 4, 2, 32, 96, 50, 8),  # group 2 (Qwen3's), rows not a multiple of the row block
        (2, 4, 2, 24, 48, 19, 2),  # two lanes, head dim not a power of two (Laneformer's is 96)
        (1, 6, 2, 16, 40, 3, 16),  # group 3 (padded), more splits than keys, K not a multiple of the tile
        (1, 4, 1, 16, 32, 0, 2),  # the first token
    ],
)
def test_qkv_attention_matches_reference(dtype, fused, lanes, num_heads, num_kv, hd, k, pos, splits):
    run_case(dtype, lanes, num_heads, num_kv, hd, k, pos, splits, fused=fused)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("fused", fused_params())
def test_qk_norm_rotate_half_bias_and_window(dtype, fused):
    # Qwen3's q/k norm and rotate-half RoPE, Qwen2's bias, a windowed layer, small tiles and all of them
    # prefetched
    run_case(dtype, 1, 4, 2, 32, 64, 45, 4, fused=fused, window=20, interleaved=False, qk_norm=True,
             with_bias=True, block_n=4, block_k=16, prefetch=64)  # fmt: skip


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("fused", fused_params())
def test_layer_zero_reads_the_embedding_row(dtype, fused):
    run_case(dtype, 2, 8, 4, 16, 32, 12, 4, fused=fused, from_token=True)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's refusal")
def test_one_launch_needs_a_hopper_gpu():
    with pytest.raises(ValueError, match="fused: needs a Hopper GPU"):
        run_case(torch.float32, 1, 4, 1, 16, 32, 3, 2, fused=True)


@pytest.mark.skipif(not ON_GPU, reason="the choice between one launch and two is a GPU's")
def test_more_splits_than_a_cluster_holds_take_two_launches():
    # 32 splits: clusters hold at most 16 programs, so the projection and the attention launch separately
    run_case(torch.float32, 1, 8, 2, 16, 32, 90, 32, fused=None, max_len=96)
    with pytest.raises(ValueError, match="fused: needs a Hopper GPU and splits in"):
        run_case(torch.float32, 1, 8, 2, 16, 32, 90, 32, fused=True, max_len=96)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="qkv: expected contiguous"):
        qkv_attention(randn(1, 32), randn(1, 96, 32), randn(1, 95), randn(1, 8, 32), randn(1, 8, 32),
                      torch.zeros(1, dtype=torch.int32, device=DEVICE), randn(8, 16), randn(8, 16), randn(1, 32),
                      AttentionScratch(1, 1, 32, 2, DEVICE), num_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="x: expected"):
        qkv_attention(randn(1, 31), randn(1, 96, 32), randn(1, 96), randn(1, 8, 32), randn(1, 8, 32),
                      torch.zeros(1, dtype=torch.int32, device=DEVICE), randn(8, 16), randn(8, 16), randn(1, 32),
                      AttentionScratch(1, 1, 32, 2, DEVICE), num_heads=1)  # fmt: skip
