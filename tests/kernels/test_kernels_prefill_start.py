"""The prefill kernels from a start position: a prompt's part after a prefix whose keys and values the cache holds
already (prefix reuse) gives the rows a prefill of the whole prompt gives, and writes the cache rows after start."""

import pytest
import torch

from kernels.prefill_attention import prefill_attention
from tests.kernels.test_kernels_prefill_attention import make_inputs, reference
from tests.support.kernels import assert_close, poisoned


@pytest.mark.parametrize(
    "lanes,num_heads,num_kv,hd,T,start,window",
    [
        (1, 2, 2, 64, 37, 20, None),  # causal, the part starting mid-block
        (2, 4, 2, 48, 45, 32, 10),  # two lanes, GQA, a window that ends inside the reused prefix
        (2, 8, 2, 96, 40, 39, 16),  # one new row (the last prompt token, always prefilled again)
        (1, 4, 2, 32, 50, 16, 64),  # a window longer than the prompt: plain causal
    ],
)
def test_a_prefill_from_start_matches_the_whole_prompts(lanes, num_heads, num_kv, hd, T, start, window):
    dtype, qk_norm = torch.float32, num_heads == 4
    max_len = T + 5
    qkv, cos, sin, q_norm, k_norm = make_inputs(dtype, lanes, num_heads, num_kv, hd, T, max_len, qk_norm)
    want, want_k, want_v = reference(qkv, cos, sin, num_heads, num_kv, window, True, q_norm, k_norm, 1e-6)
    k_cache, v_cache = poisoned(num_kv, max_len, hd, dtype=dtype), poisoned(num_kv, max_len, hd, dtype=dtype)
    kwargs = {"num_heads": num_heads, "window": window, "q_norm": q_norm, "k_norm": k_norm, "eps": 1e-6}
    prefill_attention(qkv[:, :start], k_cache, v_cache, cos, sin, **kwargs)  # an earlier request's prompt
    out = prefill_attention(qkv[:, start:], k_cache, v_cache, cos, sin, start=start, **kwargs)
    assert out.shape == (lanes, T - start, want.shape[-1])
    assert_close(out, want[:, start:], dtype, "out")
    assert_close(k_cache[:, :T], want_k, dtype, "cached k")
    assert torch.equal(v_cache[:, :T].cpu(), want_v)
    assert k_cache[:, T:].isnan().all() and v_cache[:, T:].isnan().all(), "cache past the prompt: written"


@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_few_rows_after_a_long_prefix_with_split_keys_match_the_whole_prompts(as_tensor):
    """A verify step's shape: 9 rows after 60 cached positions, the keys shared out over 4 programs a query block
    (the start as a device scalar too, as the verify graphs pass it)."""
    lanes, num_heads, num_kv, hd, T, start, window = 2, 8, 2, 96, 69, 60, 24
    dtype = torch.float32
    qkv, cos, sin, _, _ = make_inputs(dtype, lanes, num_heads, num_kv, hd, T, T + 7)
    want, _, _ = reference(qkv, cos, sin, num_heads, num_kv, window, True, None, None, 1e-6)
    k_cache, v_cache = poisoned(num_kv, T + 7, hd, dtype=dtype), poisoned(num_kv, T + 7, hd, dtype=dtype)
    kwargs = {"num_heads": num_heads, "window": window, "eps": 1e-6}
    prefill_attention(qkv[:, :start], k_cache, v_cache, cos, sin, **kwargs)
    given = torch.tensor([start], device=qkv.device) if as_tensor else start
    out = prefill_attention(qkv[:, start:], k_cache, v_cache, cos, sin, start=given, splits=4, block_n=16,
                            split_keys=16, **kwargs)  # fmt: skip
    assert_close(out, want[:, start:], dtype, "out")


def test_a_start_past_the_cache_is_refused():
    qkv, cos, sin, _, _ = make_inputs(torch.float32, 1, 2, 2, 64, 8, 16)
    cache = poisoned(2, 16, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_len"):
        prefill_attention(qkv, cache, cache.clone(), cos, sin, num_heads=2, start=10)
    with pytest.raises(ValueError, match="start"):
        prefill_attention(qkv, cache, cache.clone(), cos, sin, num_heads=2, start=-1)


@pytest.mark.parametrize("start_dtype", [torch.int32, torch.int64])
def test_a_start_read_from_a_device_scalar_gives_the_ints_rows(start_dtype):
    """A CUDA graph replays the kernels with start in a device scalar the host writes before each replay: the
    same rows and cache rows as the int start, bit for bit, with a window ending inside the reused prefix."""
    lanes, num_heads, num_kv, hd, T, start, window = 2, 4, 2, 48, 45, 29, 10
    dtype = torch.float32
    qkv, cos, sin, q_norm, k_norm = make_inputs(dtype, lanes, num_heads, num_kv, hd, T, T + 3, True)
    kwargs = {"num_heads": num_heads, "window": window, "q_norm": q_norm, "k_norm": k_norm, "eps": 1e-6}
    runs = []
    for given in (start, torch.tensor([start], dtype=start_dtype, device=qkv.device)):
        k_cache, v_cache = poisoned(num_kv, T + 3, hd, dtype=dtype), poisoned(num_kv, T + 3, hd, dtype=dtype)
        prefill_attention(qkv[:, :start], k_cache, v_cache, cos, sin, **kwargs)
        runs.append((prefill_attention(qkv[:, start:], k_cache, v_cache, cos, sin, start=given, **kwargs),
                     k_cache, v_cache))  # fmt: skip
    for (a, *caches_a), (b, *caches_b) in zip(runs[:1], runs[1:], strict=True):
        assert torch.equal(a, b)
        for x, y in zip(caches_a, caches_b, strict=True):
            assert torch.equal(x.nan_to_num(-1.0), y.nan_to_num(-1.0))
