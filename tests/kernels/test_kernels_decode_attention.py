import pytest
import torch

import kernels
from kernels.decode_attention import AttentionScratch, decode_attention, push_layout
from tests.support.kernels import DEVICE, ON_GPU, assert_close, dtype_params, poisoned, randn


def rope(x, cos, sin, interleaved):
    """x [..., hd] rotated at one position (cos, sin [hd/2]), in either layout."""
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference(qkv, k_cache, v_cache, pos, cos, sin, num_heads, window, interleaved, q_norm, k_norm, eps):
    """fp64 attention of one token; returns (out [L, H/L*hd], k_p [KV, hd], v_p [KV, hd]) with k_p, v_p as cached."""
    lanes = qkv.shape[0]
    num_kv, _, hd = k_cache.shape
    hl, kvl, group = num_heads // lanes, num_kv // lanes, num_heads // num_kv
    qkv = qkv.double().cpu()
    q = qkv[:, : hl * hd].reshape(num_heads, hd)
    k = qkv[:, hl * hd : (hl + kvl) * hd].reshape(num_kv, hd)
    v = qkv[:, (hl + kvl) * hd :].reshape(num_kv, hd)
    if q_norm is not None:
        q, k = rms(q, q_norm.double().cpu(), eps), rms(k, k_norm.double().cpu(), eps)
    c, s = cos[pos].double().cpu(), sin[pos].double().cpu()
    q, k = rope(q, c, s, interleaved), rope(k, c, s, interleaved)
    # what the cache holds (and the kernel attends with) is rounded to the cache dtype
    k_p, v_p = k.to(k_cache.dtype).double(), v.to(v_cache.dtype).double()
    start = 0 if window is None else max(0, pos - window + 1)
    keys = torch.cat((k_cache[:, start:pos].double().cpu(), k_p[:, None]), 1)  # [KV, n, hd]
    values = torch.cat((v_cache[:, start:pos].double().cpu(), v_p[:, None]), 1)
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, n, hd]
    scores = torch.einsum("hd,hnd->hn", q, keys) * hd**-0.5
    out = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out.reshape(lanes, hl * hd), k_p, v_p


def run_case(
    dtype,
    lanes,
    num_heads,
    num_kv,
    hd,
    pos,
    max_len,
    window=None,
    interleaved=True,
    qk_norm=False,
    splits=4,
    block_t=16,
    next_window="none",
):
    """The kernel against the fp64 reference; the splits merge in a cluster on a Hopper GPU (up to 16 of them),
    through the arrival counter elsewhere."""
    qkv = randn(lanes, (num_heads + 2 * num_kv) // lanes * hd, scale=2.0)
    # Positions the kernel must not read (beyond pos, before the window) are NaN.
    k_cache, v_cache = randn(num_kv, max_len, hd, dtype=dtype), randn(num_kv, max_len, hd, dtype=dtype)
    start = 0 if window is None else max(0, pos - window + 1)
    for cache in (k_cache, v_cache):
        cache[:, pos:] = float("nan")
        cache[:, :start] = float("nan")
    angles = torch.rand(max_len, hd // 2, dtype=torch.float32) * 6.3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    q_norm = randn(hd, dtype=dtype).abs() + 0.5 if qk_norm else None
    k_norm = randn(hd, dtype=dtype).abs() + 0.5 if qk_norm else None
    want, want_k, want_v = reference(qkv, k_cache, v_cache, pos, cos, sin, num_heads, window, interleaved,
                                     q_norm, k_norm, 1e-6)  # fmt: skip
    scratch = AttentionScratch(num_kv, num_heads // num_kv, hd, splits, DEVICE)
    out = poisoned(lanes, num_heads // lanes * hd, dtype=torch.float32)
    pos_t = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    # next_window other than "none": the next layer's caches (window next_window) asked into L2, never written
    next_layer = None if next_window == "none" else (randn(*k_cache.shape, dtype=dtype),
                                                     randn(*k_cache.shape, dtype=dtype), next_window)  # fmt: skip
    next_before = None if next_layer is None else (next_layer[0].clone(), next_layer[1].clone())
    decode_attention(qkv, k_cache, v_cache, pos_t, cos, sin, out, scratch, num_heads=num_heads, window=window,
                     interleaved=interleaved, q_norm=q_norm, k_norm=k_norm, block_t=block_t,
                     next_layer=next_layer)  # fmt: skip
    if next_layer is not None:
        assert torch.equal(next_layer[0], next_before[0]) and torch.equal(next_layer[1], next_before[1])
    assert_close(out, want, dtype, "out")
    assert_close(k_cache[:, pos], want_k, dtype, "cached k")
    assert_close(v_cache[:, pos], want_v, dtype, "cached v")
    assert (scratch.counter == 0).all(), "split counters must return to zero for the next layer"
    return scratch


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "lanes,num_heads,num_kv,hd,pos",
    [
        (1, 4, 1, 16, 0),  # the first token: only itself
        (1, 8, 2, 32, 37),  # GQA group 4, a position not a multiple of anything
        (2, 4, 2, 24, 19),  # two lanes, head dim not a power of two (Laneformer's is 96)
        (2, 6, 2, 16, 50),  # group 3 (padded)
        (1, 2, 1, 16, 70),  # several blocks per split
    ],
)
def test_decode_attention_matches_reference(dtype, lanes, num_heads, num_kv, hd, pos):
    run_case(dtype, lanes, num_heads, num_kv, hd, pos, max_len=80)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_layouts_and_qk_norm(dtype, interleaved):
    run_case(dtype, 1, 4, 2, 16, 21, max_len=32, interleaved=interleaved, qk_norm=True)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("pos,window", [(40, 8), (5, 8), (33, 1)])
def test_sliding_window_reads_only_the_window(dtype, pos, window):
    run_case(dtype, 2, 4, 2, 16, pos, max_len=48, window=window)


def test_one_split_and_many_splits_agree():
    for splits in (1, 16):
        run_case(torch.float32, 1, 2, 1, 16, 29, max_len=32, splits=splits, block_t=16)


def test_counters_survive_repeated_calls():
    # the scratch is shared by every layer: a second call must see clean counters
    scratch = run_case(torch.float32, 1, 2, 1, 16, 9, max_len=16)
    assert scratch.counter.sum().item() == 0
    run_case(torch.float32, 1, 2, 1, 16, 10, max_len=16)


def test_rejects_bad_shapes():
    k_cache = randn(2, 16, 8)
    cos = torch.ones(16, 4, device=DEVICE)
    scratch = AttentionScratch(2, 2, 8, 2, DEVICE)
    with pytest.raises(ValueError, match="qkv:"):
        decode_attention(randn(1, 31), k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int32, device=DEVICE),
                         cos, cos, randn(1, 32), scratch, num_heads=4)  # fmt: skip
    with pytest.raises(ValueError, match="num_heads:"):
        decode_attention(randn(1, 64), k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int32, device=DEVICE),
                         cos, cos, randn(1, 24), scratch, num_heads=3)  # fmt: skip


@pytest.mark.skipif(not ON_GPU, reason="thread-block clusters need a Hopper GPU (not the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "lanes,num_heads,num_kv,hd,pos,splits,window,interleaved,qk_norm",
    [
        (1, 32, 8, 64, 600, 16, None, False, False),  # Llama-3.2-1B's heads, 16-program clusters
        (1, 16, 8, 128, 700, 16, None, False, True),  # Qwen3-1.7B's (q/k norm, rotate-half)
        (2, 8, 4, 96, 333, 8, None, True, False),  # two lanes, head dim 96, 8-program clusters
        (1, 6, 2, 16, 0, 16, None, True, False),  # the first token: one split has it, 15 are empty
        (1, 8, 2, 32, 90, 4, 16, True, False),  # a window, 4-program clusters
        (1, 4, 2, 16, 41, 2, None, True, False),  # group 2, 2-program clusters
        (
            1,
            4,
            2,
            16,
            50,
            16,
            None,
            True,
            False,
        ),  # group 2 over 16 splits: 2 elements a program (push: 2 a chunk)
        (1, 2, 2, 16, 50, 16, None, True, False),  # no grouping: 1 element a program (push: 1 a chunk)
        # head dim 256, group 8: the push's ~50 KB of shared memory past the kernel's ~32 KB need the opt-in
        (1, 16, 2, 256, 70, 16, None, False, True),
    ],
)
def test_cluster_merge_matches_reference(dtype, lanes, num_heads, num_kv, hd, pos, splits, window, interleaved,
                                         qk_norm):  # fmt: skip
    # The split partials pushed into the owners' shared memory in a cluster (kernels/cluster.py) instead of merged
    # through the counter. Run twice, at consecutive positions, so that a program reading a stale partial of the
    # call before would show.
    for p in (pos, pos + 1):
        run_case(dtype, lanes, num_heads, num_kv, hd, p, max_len=p + 8, window=window, interleaved=interleaved,
                 qk_norm=qk_norm, splits=splits, block_t=64)  # fmt: skip


@pytest.mark.parametrize(
    "group,hd,splits,want",
    [
        (2, 128, 16, (16, 4, 4, 16 + (256 + 4) * 4 + 16 * 20 * 4 + 16)),  # qwen3-1.7b: 16 elements, 4 a push
        (4, 64, 16, (16, 4, 8, 16 + (256 + 8) * 4 + 16 * 24 * 4 + 16)),  # llama-3.2-1b: m, l of 4 heads
        (1, 16, 16, (1, 1, 2, 16 + (16 + 2) * 4 + 16 * 3 * 4 + 16)),  # one element a program
        (3, 96, 8, (64, 4, 8, 16 + (512 + 8) * 4 + 8 * 72 * 4 + 16)),  # padded: group 4, head dim 128
    ],
)
def test_push_layout(group, hd, splits, want):
    assert push_layout(group, hd, splits) == want


@pytest.mark.skipif(not ON_GPU, reason="the choice between clusters and the counter is a GPU's")
def test_more_splits_than_a_cluster_holds_use_the_counter():
    # 32 splits: clusters hold at most 16 programs, so the kernel merges through the counter
    scratch = run_case(torch.float32, 1, 8, 2, 32, 90, max_len=96, splits=32, block_t=16)
    assert (scratch.counter == 0).all()


def test_split_counts_must_be_powers_of_two():
    for splits in (0, 12):
        with pytest.raises(ValueError, match="splits: expected a power of two"):
            AttentionScratch(2, 2, 16, splits, DEVICE)


def test_sm90_features_need_a_hopper_gpu(monkeypatch):
    # clusters and griddepcontrol are sm_90 instructions: an Ampere GPU keeps the counter merge and plain launches
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    for capability, expected in (((8, 0), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert kernels.hopper_features(torch.device("cuda")) is expected
    assert kernels.hopper_features(torch.device("meta"))
    assert not kernels.hopper_features(torch.device("cpu"))


@pytest.mark.skipif(not ON_GPU, reason="the L2 bulk prefetch is an sm_90 instruction (not the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lanes,num_heads,num_kv,hd,pos,splits,window,next_window",
    [
        (2, 8, 4, 96, 333, 8, None, None),  # Laneformer's head dim, two lanes, two key blocks a split
        (1, 32, 8, 64, 600, 16, None, None),  # Llama-3.2-1B's heads
        (1, 8, 2, 32, 90, 4, 16, None),  # this layer windowed, the next one not
        (1, 8, 2, 32, 90, 4, None, 16),  # the next layer windowed: other ranges than this layer's
        (1, 6, 2, 16, 0, 16, None, None),  # the first token: nothing cached to ask for
    ],
)
def test_next_layer_prefetch_changes_nothing(
    dtype, lanes, num_heads, num_kv, hd, pos, splits, window, next_window
):
    # the same output and cache writes as without it (run_case), and the next layer's caches untouched
    for p in (pos, pos + 1):
        run_case(dtype, lanes, num_heads, num_kv, hd, p, max_len=p + 8, window=window, splits=splits, block_t=64,
                 next_window=next_window)  # fmt: skip


@pytest.mark.parametrize("dtype", dtype_params())
def test_a_long_context_over_several_blocks_a_split(dtype):
    # the cache's keys and values read in several blocks a split, the next one in flight (evict-first hint)
    run_case(dtype, 2, 8, 4, 96 if ON_GPU else 24, 150, max_len=160, splits=4, block_t=16 if ON_GPU else 32)


def test_next_layer_prefetch_refusals():
    pos = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    cos = torch.ones(16, 6, device=DEVICE)

    def attend(k_cache, next_layer):
        hd = k_cache.shape[-1]
        decode_attention(randn(1, 4 * hd), k_cache, k_cache.clone(), pos, cos[:, : hd // 2], cos[:, : hd // 2],
                         randn(1, 2 * hd), AttentionScratch(1, 2, hd, 2, DEVICE), num_heads=2,
                         next_layer=next_layer)  # fmt: skip

    k_cache = randn(1, 16, 8, dtype=torch.float16)
    with pytest.raises(
        ValueError, match="next_layer: expected contiguous, 16-byte aligned caches shaped like"
    ):
        attend(k_cache, (randn(1, 8, 8, dtype=torch.float16), k_cache.clone(), None))
    wide = randn(1, 16, 16, dtype=torch.float16)
    for strided in (wide[:, :, :8], wide.view(-1)[4:132].view(1, 16, 8)):  # not contiguous; 8 bytes off
        with pytest.raises(ValueError, match="next_layer: expected contiguous, 16-byte aligned"):
            attend(k_cache, (strided, k_cache.clone(), None))
    # rows of 12 fp16 elements are 24 bytes: no 16-byte multiple for the bulk prefetch (and no GPU under the
    # interpreter at all)
    odd = randn(1, 16, 12, dtype=torch.float16)
    with pytest.raises(ValueError, match="next_layer: the L2 prefetch needs a Hopper GPU and cache rows"):
        attend(odd, (odd.clone(), odd.clone(), None))
    if not ON_GPU:
        with pytest.raises(ValueError, match="under the interpreter"):
            attend(k_cache, (k_cache.clone(), k_cache.clone(), None))
