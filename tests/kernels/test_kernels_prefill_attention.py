import pytest
import torch

from inference.model import apply_rope, attention_mask, rms_norm, rope_pairs
from kernels.prefill_attention import head_dim_parts, key_splits, prefill_attention
from kernels.prefill_kv_write import prefill_kv_write
from tests.support.kernels import DEVICE, assert_close, dtype_params, poisoned, randn


def rope(x, cos, sin, interleaved):
    """model.py's rotation (rounded to x's dtype) of x [heads, T, hd] at positions 0 .. T-1, in either layout;
    cos, sin [T, hd/2]."""
    if interleaved:
        return apply_rope(x, *rope_pairs(cos, sin))
    half = x.shape[-1] // 2
    x0, x1 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).type_as(x)


def reference(qkv, cos, sin, num_heads, num_kv, window, interleaved, q_norm, k_norm, eps):
    """(out [L, T, H/L*hd], cached k [KV, T, hd], cached v [KV, T, hd]): model.Block.attention's math with the
    model.py helpers (norm, RoPE and their rounding in the input dtype), the softmax in fp64."""
    lanes, T, _ = qkv.shape
    hd = cos.shape[1] * 2
    hl, kvl, group = num_heads // lanes, num_kv // lanes, num_heads // num_kv
    qkv = qkv.cpu()
    q, k, v = (t.reshape(lanes, T, -1, hd).permute(0, 2, 1, 3).flatten(0, 1)  # [heads, T, hd], lane-major
               for t in qkv.split([hl * hd, kvl * hd, kvl * hd], dim=-1))  # fmt: skip
    if q_norm is not None:
        q, k = rms_norm(q, q_norm.cpu(), eps), rms_norm(k, k_norm.cpu(), eps)
    cos, sin = cos[:T].cpu(), sin[:T].cpu()
    q, k = rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved)
    keys, values = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = q.double() @ keys.mT * hd**-0.5  # [H, T, T]
    scores = scores.masked_fill(~attention_mask(0, T, 0, T, window, torch.device("cpu")), float("-inf"))
    out = scores.softmax(-1) @ values  # [H, T, hd]
    out = out.unflatten(0, (lanes, hl)).permute(0, 2, 1, 3).reshape(lanes, T, hl * hd)
    return out, k, v


def make_inputs(dtype, lanes, num_heads, num_kv, hd, T, max_len, qk_norm=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = randn(lanes, T, (num_heads + 2 * num_kv) // lanes * hd, dtype=dtype, scale=2.0, gen=gen)
    angles = torch.rand(max_len, hd // 2, generator=gen) * 6.3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    q_norm = (randn(hd, gen=gen).abs() + 0.5).to(dtype) if qk_norm else None
    k_norm = (randn(hd, gen=gen).abs() + 0.5).to(dtype) if qk_norm else None
    return qkv, cos, sin, q_norm, k_norm


def run_case(dtype, lanes, num_heads, num_kv, hd, T, window=None, interleaved=True, qk_norm=False,
             max_len=None, **blocks):  # fmt: skip
    max_len = max_len or T + 5
    qkv, cos, sin, q_norm, k_norm = make_inputs(dtype, lanes, num_heads, num_kv, hd, T, max_len, qk_norm)
    # The cache past T is NaN: a kernel that reads (or writes) beyond the prompt shows up in the comparison.
    k_cache, v_cache = poisoned(num_kv, max_len, hd, dtype=dtype), poisoned(num_kv, max_len, hd, dtype=dtype)
    want, want_k, want_v = reference(qkv, cos, sin, num_heads, num_kv, window, interleaved, q_norm, k_norm,
                                     1e-6)  # fmt: skip
    out = prefill_attention(qkv, k_cache, v_cache, cos, sin, num_heads=num_heads, window=window,
                            interleaved=interleaved, q_norm=q_norm, k_norm=k_norm, eps=1e-6, **blocks)  # fmt: skip
    assert out.dtype == dtype
    assert_close(out, want, dtype, "out")
    assert_close(k_cache[:, :T], want_k, dtype, "cached k")
    assert torch.equal(v_cache[:, :T].cpu(), want_v), "cached v: the values are copied as they are"
    assert k_cache[:, T:].isnan().all() and v_cache[:, T:].isnan().all(), "cache past T: written"


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "lanes,num_heads,num_kv,hd,T,window",
    [
        (1, 2, 2, 64, 37, None),  # causal, no GQA, T not a multiple of the block
        (2, 4, 2, 48, 45, 10),  # two lanes, GQA 2, an odd head dim, window shorter than T
        (1, 4, 1, 64, 30, 64),  # GQA 4, window longer than T: plain causal
        (2, 8, 2, 96, 20, 20),  # Laneformer's head dim, window = T
        (2, 4, 2, 64, 60, 40),  # blocks before, inside and after the unmasked range
    ],
)
def test_prefill_attention_matches_reference(dtype, lanes, num_heads, num_kv, hd, T, window):
    run_case(dtype, lanes, num_heads, num_kv, hd, T, window)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_rope_layouts_and_qk_norm(dtype, interleaved, qk_norm):
    # head dim 48 = 32 + 16: rotate-half partners (d +- 24) cross the two parts
    run_case(dtype, 2, 4, 2, 48, 33, window=20, interleaved=interleaved, qk_norm=qk_norm)


@pytest.mark.parametrize("T,window", [(1, None), (19, 1), (5, 3)])
def test_short_prompts_and_tiny_windows(T, window):
    run_case(torch.float32, 1, 2, 1, 16, T, window)


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_block_sizes_agree(block_m, block_n):
    # query and key blocks of different sizes: the masked / unmasked split must still cover every key
    run_case(torch.float32, 2, 4, 2, 16, 70, window=24, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize(
    "lanes,num_heads,num_kv,hd,T,window,splits",
    [
        (1, 2, 2, 64, 37, None, 2),  # causal: the diagonal block in the last split only
        (2, 4, 2, 48, 70, 24, 4),  # a window: its lower edge inside some splits, others wholly visible
        (2, 8, 2, 96, 45, None, 8),  # the head dim in two parts; more splits than some rows have key blocks
        (1, 2, 1, 16, 19, 1, 16),  # a window of one key: most splits see none of a row's keys
    ],
)
def test_keys_split_across_programs_give_the_one_pass_rows(lanes, num_heads, num_kv, hd, T, window, splits):
    run_case(torch.float32, lanes, num_heads, num_kv, hd, T, window, block_m=16, block_n=16, splits=splits,
             split_keys=16)  # fmt: skip


@pytest.mark.parametrize("split_keys", [32, 48, 1024])
def test_a_block_splits_its_keys_once_per_split_keys_and_one_split_writes_the_heads_itself(split_keys):
    # 70 keys in blocks of 16: 2 splits of 32 keys, 1 of 48 (a one-pass block), none past one at 1024
    run_case(torch.float32, 2, 4, 2, 16, 70, None, block_m=16, block_n=16, splits=4, split_keys=split_keys)


def test_keys_are_split_only_where_the_query_blocks_leave_multiprocessors_idle():
    assert key_splits(programs=132, multiprocessors=132) == 1
    assert key_splits(programs=32, multiprocessors=132) == 16  # laneformer-2b's 9-row verify step: 32 heads
    assert key_splits(programs=64, multiprocessors=132) == 8
    assert key_splits(programs=100, multiprocessors=132) == 4
    assert key_splits(programs=1, multiprocessors=132, most=8) == 8


def test_head_dims_split_into_power_of_two_parts_or_pad():
    assert [head_dim_parts(hd) for hd in (96, 48, 80, 64, 128, 24, 8, 112)] == [
        (64, 32), (32, 16), (64, 16), (64, 0), (128, 0), (32, 0), (16, 0), (128, 0)
    ]  # fmt: skip


def test_kv_write_alone_fills_the_cache_up_to_T():
    T, max_len = 21, 32
    qkv, cos, sin, _, k_norm = make_inputs(torch.float32, 2, 4, 2, 24, T, max_len, qk_norm=True)
    k_cache, v_cache = (poisoned(2, max_len, 24, dtype=torch.float32) for _ in range(2))
    prefill_kv_write(qkv, k_cache, v_cache, cos, sin, num_heads=4, interleaved=False, k_norm=k_norm, eps=1e-6)
    _, want_k, want_v = reference(qkv, cos, sin, 4, 2, None, False, k_norm, k_norm, 1e-6)
    assert_close(k_cache[:, :T], want_k, torch.float32, "cached k")
    assert torch.equal(v_cache[:, :T].cpu(), want_v)
    assert k_cache[:, T:].isnan().all() and v_cache[:, T:].isnan().all()


def test_writes_into_a_given_output():
    qkv, cos, sin, _, _ = make_inputs(torch.float32, 2, 4, 2, 16, 9, 16)
    cache = torch.zeros(2, 16, 16, device=DEVICE)
    out = poisoned(2, 9, 32, dtype=torch.float32)
    got = prefill_attention(qkv, cache, cache.clone(), cos, sin, num_heads=4, out=out)
    assert got is out
    assert_close(out, reference(qkv, cos, sin, 4, 2, None, True, None, None, 1e-6)[0], torch.float32)


def test_names_bad_arguments():
    lanes, heads, kv, hd, T = 2, 4, 2, 16, 8
    qkv = randn(lanes, T, (heads + 2 * kv) // lanes * hd)
    cache = torch.zeros(kv, 16, hd, device=DEVICE)
    cos = torch.ones(16, hd // 2, device=DEVICE)
    norm = torch.ones(hd, device=DEVICE)

    def call(qkv=qkv, k_cache=cache, v_cache=None, cos=cos, sin=cos, **kwargs):
        kwargs = {"num_heads": heads, **kwargs}
        v_cache = cache.clone() if v_cache is None else v_cache
        prefill_attention(qkv, k_cache, v_cache, cos, sin, **kwargs)

    bad = [
        ("qkv", {"qkv": randn(lanes, T, 63)}),  # not (H/L + 2 KV/L) * hd wide
        ("qkv", {"qkv": randn(lanes * T, 64)}),  # not [L, T, ...]
        ("qkv", {"qkv": randn(lanes, 17, 64)}),  # longer than the cache
        ("num_heads", {"num_heads": 3}),
        ("k_cache", {"v_cache": torch.zeros(kv, 12, hd, device=DEVICE)}),  # caches of different shapes
        ("k_cache", {"k_cache": cache.half(), "v_cache": cache.half()}),  # not qkv's dtype
        ("k_cache", {"k_cache": randn(kv, 16, 15), "v_cache": randn(kv, 16, 15)}),  # odd head dim
        ("cos", {"cos": torch.ones(16, hd, device=DEVICE)}),
        ("cos", {"cos": cos.double(), "sin": cos.double()}),
        ("cos", {"cos": cos[:4], "sin": cos[:4]}),  # shorter than the prompt
        ("q_norm", {"q_norm": norm}),  # without k_norm
        ("k_norm", {"q_norm": norm, "k_norm": torch.ones(hd + 1, device=DEVICE)}),
        ("window", {"window": 0}),
        ("out", {"out": torch.empty(lanes, T, 31, device=DEVICE)}),
        ("block_m", {"block_m": 24}),
        ("splits", {"splits": 3}),
        ("split_keys", {"splits": 2, "split_keys": 24, "block_n": 16}),
    ]
    for name, kwargs in bad:
        with pytest.raises(ValueError, match=name):
            call(**kwargs)
