"""The attention norm, the q|k|v projection and decode attention in one launch (Hopper): no kernel boundary
between the projection and the attention that reads it.

KV head g's query heads, key head and value head only ever meet each other (GQA stays inside a head group), so
the (G + 2) * hd rows of q|k|v that g's attention needs are projected by g's own thread-block cluster, the same
SPLITS programs that then attend over g's cache splits (kernels/decode_attention.py):

    program (g, s) of cluster g:  rows [s * ROWS, (s + 1) * ROWS) of g's group   (ROWS = ceil((G + 2) hd / SPLITS))
        out_rows = W[rows] @ (rmsnorm(x[lane]) * norm)  (+ bias)      -> qkv, the same buffer rmsnorm_gemv fills
        cluster barrier (release / acquire: every program of g sees all of g's rows)
        attention split s of head g, and the merge of g's splits           -> out

Where the separate kernels pay a launch boundary (the attention's programs become resident and wait on the
whole q|k|v grid: ~1-2 us a layer), this pays one cluster barrier (~0.3 us), and the first block of cached keys
is requested together with the first weight tiles, before the wait on the kernel that wrote x.

Rows of a head group, in the lane's q|k|v layout (heads lane-major): its G query heads, then its key head, then
its value head. Bytes: the q|k|v weight once, as rmsnorm_gemv; x and the norm once per program (L2 hits).

Without clusters (the interpreter, an older GPU, more than 16 splits) the projection runs as its own launch
with the same program layout, then decode_attention: the same results from two launches, which is how CI
tests the projection's row mapping.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import hopper_features, pdl_kwargs
from kernels.cluster import CLUSTER_SIZES, cluster_sync, launch_clusters
from kernels.decode_attention import (
    AttentionScratch,
    attend,
    attention_arguments,
    cache_block,
    decode_attention,
    split_keys,
)
from kernels.rmsnorm_gemv import input_strides, normed_x_tiles, row_dots, weight_tiles


@triton.jit
def group_rows(part, block, kv_in_lane, heads_per_lane, kv_per_lane, G: tl.constexpr, HD: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Block `block` of BLOCK_N rows of this program's share (part) of its head group: their lane-local q|k|v row
    indices and which of them exist."""
    local = block * BLOCK_N + tl.arange(0, BLOCK_N)
    j = part * ROWS + local  # row of the group: G * HD query rows, then HD key rows, then HD value rows
    ok = (local < ROWS) & (j < (G + 2) * HD)
    q_end: tl.constexpr = G * HD
    row = tl.where(
        j < q_end,
        kv_in_lane * q_end + j,
        tl.where(
            j < q_end + HD,
            (heads_per_lane + kv_in_lane) * HD + j - q_end,
            (heads_per_lane + kv_per_lane + kv_in_lane) * HD + j - q_end - HD,
        ),
    )
    return row, ok


@triton.jit
def _qkv_attention_kernel(
    x_ptr,
    stride_x_lane,
    token_ptr,
    norm_ptr,
    stride_norm_lane,
    w_ptr,
    bias_ptr,
    # decode_attention's arguments, in its kernel's order (attention_arguments)
    qkv_ptr,
    stride_qkv_lane,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    part_o_ptr,
    part_ml_ptr,
    counter_ptr,
    out_ptr,
    stride_out_lane,
    heads_per_lane,
    kv_per_lane,
    window,
    max_len,
    scale_log2e,
    eps,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_FROM_TOKEN: tl.constexpr,
    ATTEND: tl.constexpr,
    HD: tl.constexpr,
    HDP: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QK_NORM: tl.constexpr,
    CLUSTER: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    ROW_BLOCKS: tl.constexpr = (ROWS + BLOCK_N - 1) // BLOCK_N
    kv = tl.program_id(0) // SPLITS  # with ATTEND, programs [kv * SPLITS, (kv + 1) * SPLITS) form a cluster
    split = tl.program_id(0) % SPLITS
    lane = kv // kv_per_lane
    kv_in_lane = kv % kv_per_lane
    n_lane = (heads_per_lane + 2 * kv_per_lane) * HD  # q|k|v rows of a lane
    cols = tl.arange(0, BLOCK_K)

    # In flight before the wait on the kernel that wrote x: the first weight tiles, and the first block of this
    # split's cached keys (written by earlier steps).
    rows, row_ok = group_rows(split, 0, kv_in_lane, heads_per_lane, kv_per_lane, G, HD, ROWS, BLOCK_N)
    w_offs = (lane * n_lane + rows).to(tl.int64)[:, None] * K + cols[None, :]  # [BLOCK_N, BLOCK_K]
    w = weight_tiles(w_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, PREFETCH)
    if ATTEND:
        pos, lo, hi, hi_cached = split_keys(pos_ptr, window, split, SPLITS, BLOCK_T)
        kv_base = kv.to(tl.int64) * max_len * HD
        k_first, v_first = cache_block(k_cache_ptr, v_cache_ptr, kv_base, lo, hi_cached, HD, HDP, BLOCK_T)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    w = w + weight_tiles(w_ptr, w_offs, row_ok, cols, K, BLOCK_K, PREFETCH, TILES - PREFETCH)
    x_row = x_ptr + tl.load(token_ptr).to(tl.int64) * K if X_FROM_TOKEN else x_ptr + lane * stride_x_lane
    xs, rstd = normed_x_tiles(x_row, norm_ptr + lane * stride_norm_lane, cols, eps, K, BLOCK_K, HAS_NORM)

    # The program's rows block by block, the next block's weights in flight while this one's are summed.
    for b in tl.static_range(ROW_BLOCKS):
        if b + 1 < ROW_BLOCKS:
            next_rows, next_ok = group_rows(split, b + 1, kv_in_lane, heads_per_lane, kv_per_lane, G, HD, ROWS,
                                            BLOCK_N)  # fmt: skip
            next_offs = (lane * n_lane + next_rows).to(tl.int64)[:, None] * K + cols[None, :]
            next_w = weight_tiles(w_ptr, next_offs, next_ok, cols, K, BLOCK_K, 0, TILES)
        y = row_dots(w, xs, BLOCK_N, BLOCK_K) * rstd  # [BLOCK_N]
        if HAS_BIAS:
            y += tl.load(bias_ptr + lane * n_lane + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(qkv_ptr + lane * stride_qkv_lane + rows, y.to(qkv_ptr.dtype.element_ty), mask=row_ok)
        if b + 1 < ROW_BLOCKS:
            rows, row_ok, w = next_rows, next_ok, next_w

    if ATTEND:
        # The group's rows are in memory once every program of the cluster has stored its share; attend's loads
        # take their addresses from the barrier's result, so none of them moves above it.
        ready = cluster_sync(split * 0)
        attend(qkv_ptr + ready, stride_qkv_lane, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, q_norm_ptr,
               k_norm_ptr, part_o_ptr, part_ml_ptr, counter_ptr, out_ptr, stride_out_lane, heads_per_lane,
               kv_per_lane, max_len, scale_log2e, eps, kv, split, pos, lo, hi, hi_cached, k_first, v_first,
               HD, HDP, G, GP, BLOCK_H, SPLITS, BLOCK_T, INTERLEAVED, QK_NORM, CLUSTER)  # fmt: skip


def fusable(device: torch.device, splits: int) -> bool:
    """Whether qkv_attention runs as one launch on `device` with `splits` attention splits (its clusters)."""
    return hopper_features(device) and splits in CLUSTER_SIZES


def qkv_attention(
    x: torch.Tensor,
    weight: torch.Tensor,
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    scratch: AttentionScratch,
    *,
    num_heads: int,
    norm_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    token: torch.Tensor | None = None,
    window: int | None = None,
    interleaved: bool = True,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    use_pdl: bool = False,
    fused: bool | None = None,
    prefetch: int = 1,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    block_t: int = 64,
) -> torch.Tensor:
    """rmsnorm_gemv's q|k|v (x, weight, norm_weight, bias, token as there; qkv is its out) followed by
    decode_attention (qkv, k_cache ... out, scratch, num_heads, window ... as there), as one launch.

    fused: one launch whose clusters hand the rows over (True), two launches (False), or the first where it
    can run (None: a Hopper GPU and a split count that is a cluster size). prefetch: weight tiles
    [block_n, block_k] a program loads before it waits for x. num_warps: the fused launch's, and the two
    launches' (None: 4, and decode_attention's own choice).
    """
    if weight.dim() != 3 or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [L, N, K] tensor, got {tuple(weight.shape)}")
    lanes, n, k = weight.shape
    if qkv.shape != (lanes, n) or not qkv.is_contiguous():
        raise ValueError(f"qkv: expected contiguous ({lanes}, {n}), got {tuple(qkv.shape)}")
    if bias is not None and (bias.shape != (lanes, n) or not bias.is_contiguous()):
        raise ValueError(f"bias: expected contiguous ({lanes}, {n}), got {tuple(bias.shape)}")
    stride_x_lane, stride_norm_lane = input_strides(x, token, norm_weight, lanes, k)
    can_fuse = fusable(k_cache.device, scratch.splits)
    if fused is None:
        fused = can_fuse
    elif fused and not can_fuse:
        raise ValueError(
            f"fused: needs a Hopper GPU and splits in {CLUSTER_SIZES}, got {scratch.splits} splits"
        )
    attention_args, attention_constexprs = attention_arguments(
        qkv, k_cache, v_cache, pos, cos, sin, out, scratch, num_heads=num_heads, window=window,
        interleaved=interleaved, q_norm=q_norm, k_norm=k_norm, eps=eps, block_t=block_t,
        cluster=True if fused else None,
    )  # fmt: skip
    splits, hd, group = scratch.splits, k_cache.shape[2], num_heads // k_cache.shape[0]
    rows = triton.cdiv((group + 2) * hd, splits)
    block_n = block_n or min(8, triton.next_power_of_2(rows))
    block_k = block_k or min(1024, triton.next_power_of_2(k))
    if prefetch < 1:
        raise ValueError(f"prefetch: expected at least 1 tile, got {prefetch}")
    args = (x, stride_x_lane, token if token is not None else x, norm_weight if norm_weight is not None else x,
            stride_norm_lane, weight, bias if bias is not None else weight, *attention_args)  # fmt: skip
    options = dict(
        attention_constexprs,
        K=k,
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PREFETCH=min(prefetch, triton.cdiv(k, block_k)),
        HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        X_FROM_TOKEN=token is not None,
        ATTEND=fused,
        USE_PDL=use_pdl,
        num_warps=num_warps or 4,
        **pdl_kwargs(use_pdl),
    )
    programs = k_cache.shape[0] * splits
    if fused:
        launch_clusters(_qkv_attention_kernel, k_cache.shape[0], splits, args, options)
        return out
    _qkv_attention_kernel[(programs,)](*args, **options)
    return decode_attention(qkv, k_cache, v_cache, pos, cos, sin, out, scratch, num_heads=num_heads,
                            window=window, interleaved=interleaved, q_norm=q_norm, k_norm=k_norm, eps=eps,
                            use_pdl=use_pdl, block_t=block_t, num_warps=num_warps)  # fmt: skip
