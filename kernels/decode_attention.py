"""One decode step of attention: RoPE (and Qwen3's q/k norm) on this token's q and k, the KV-cache write, and
split-KV (flash-decoding) attention with GQA and sliding windows, combined in the same launch.

For KV head g (lane l = g // (KV/L), heads are lane-major) and the token at position p:
    q_j = rope(qknorm(q_j), p) * hd^-0.5 for the G = H/KV query heads j of g;  k_p = rope(qknorm(k), p);  v_p = v
    cache[g, p] = (k_p, v_p)
    out_j = softmax_t(q_j . k_t) @ v_t   over t in [p - W + 1, p] (windowed layers) or [0, p]

RoPE rotates dim d with its partner: d ^ 1 (interleaved pairs) or d +- hd/2 (rotate-half); the cache keeps
keys in the model's layout. Grid: (KV heads, SPLITS); each program streams one contiguous chunk of the cache
with the next block's loads in flight while it computes the current one, and hands its unnormalised partial
(o, max, sum) to the merge. The G query heads of a KV head are padded to 16 rows so that both products run on
the tensor cores (tl.dot), as in flash-decoding; the padding costs no memory traffic. The token's own key and
value come from registers, not from a re-read of the cache. The partials are merged in the same launch:
- on a Hopper GPU, a KV head's splits form one thread-block cluster (kernels/cluster.py) and each split merges
  1/SPLITS of the head group's output elements: every split pushes each owner its slice straight into the
  owner's shared memory (st.async, counted in bytes by the owner's mbarrier: _push_merge). Against the counter
  below it saves the partials' round trip through global memory and the merge's tail (docs/fast-path.md);
- otherwise (the interpreter, or more than 16 splits) the last split of a head to finish, found by an
  atomic counter, merges all of them.

Once its own reads are done, each program also asks L2 for the first block of cached keys and values its split
will read in the next layer (`next_layer`): that launch, a chain of dependent reads whose programs often start
only as the q|k|v kernel drains, then finds its first block in L2 instead of HBM. The request costs no busy
bandwidth: the merge leaves the memory idle, and the next layer reads the same bytes anyway.

Bytes: (p + 1) * hd * 2 cache elements per KV head (W of them in windowed layers), this token's q/k/v once.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import hopper_features, interpreted, pdl_kwargs
from kernels.cluster import (
    CLUSTER_SIZES,
    exchange_arm,
    exchange_ready,
    exchange_region,
    launch_clusters,
    load_local,
    push,
    store_local,
    wait_inbox,
)
from kernels.rope import rope_pairing


@triton.jit
def _decode_attention_kernel(
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
    next_k_ptr,
    next_v_ptr,
    heads_per_lane,
    kv_per_lane,
    window,
    next_window,
    max_len,
    scale_log2e,
    eps,
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
    PREFETCH_NEXT: tl.constexpr,
    PUSH_E: tl.constexpr,
    PUSH_VEC: tl.constexpr,
    PUSH_MLP: tl.constexpr,
    PUSH_BYTES: tl.constexpr,
    THREADS: tl.constexpr,
):
    if CLUSTER:  # one cluster of SPLITS programs a KV head (kernels/cluster.py)
        kv = tl.program_id(0) // SPLITS
        split = tl.program_id(0) % SPLITS
        # the inbox the peers push their partials into, armed before anything waits (_push_merge)
        region = exchange_region(split * 0 + PUSH_BYTES)
        armed = exchange_arm(region, split * 0 + SPLITS * (PUSH_E + PUSH_MLP) * 4)
    else:
        kv = tl.program_id(0)
        split = tl.program_id(1)
    lane = kv // kv_per_lane
    kv_in_lane = kv % kv_per_lane
    heads = tl.arange(0, BLOCK_H)  # query rows: the G heads of this KV head, padded for tl.dot
    head_ok = heads < G
    d = tl.arange(0, HDP)
    d_ok = d < HD
    partner, pair, first = rope_pairing(d, HD, INTERLEAVED)
    sign = tl.where(first, -1.0, 1.0)

    # This split's keys [lo, hi); the cache holds positions < pos, the token itself comes from qkv.
    pos = tl.load(pos_ptr, cache_modifier=".cg")
    start = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    n_keys = pos + 1 - start
    chunk = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_T) * BLOCK_T
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, pos + 1)
    hi_cached = tl.minimum(hi, pos)
    kv_base = kv.to(tl.int64) * max_len * HD
    t = lo + tl.arange(0, BLOCK_T)
    kv_offs = kv_base + t[:, None] * HD + d[None, :]
    kv_mask = (t < hi_cached)[:, None] & d_ok[None, :]
    # The first block of cached keys was written by earlier steps: in flight before we wait for q, k, v. Read
    # once a step, the keys and values take L2's evict-first hint, as the weights do: the weight stream needs
    # the room.
    k_next = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0, eviction_policy="evict_first")
    v_next = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0, eviction_policy="evict_first")
    # So are Qwen3's q/k norm weights (they do not come from the previous kernel either).
    if QK_NORM:
        q_gain = tl.load(q_norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        q_gain_partner = tl.load(q_norm_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
        k_gain = tl.load(k_norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        k_gain_partner = tl.load(k_norm_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()

    lane_qkv = qkv_ptr + lane * stride_qkv_lane
    q_rows = lane_qkv + (kv_in_lane * G + heads)[:, None] * HD  # [BLOCK_H, 1]
    q_mask = head_ok[:, None] & d_ok[None, :]
    q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    k_row = lane_qkv + (heads_per_lane + kv_in_lane) * HD
    k = tl.load(k_row + d, mask=d_ok, other=0.0).to(tl.float32)
    k_partner = tl.load(k_row + partner, mask=d_ok, other=0.0).to(tl.float32)
    v_row = lane_qkv + (heads_per_lane + kv_per_lane + kv_in_lane) * HD
    v = tl.load(v_row + d, mask=d_ok, other=0.0)
    cos = tl.load(cos_ptr + pos * (HD // 2) + pair, mask=d_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * (HD // 2) + pair, mask=d_ok, other=0.0)
    # Qwen3's q/k norm: the gains before RoPE, the scalar 1 / rms after it (a rotation keeps the norm). In this
    # order the partner loads are used before the norm's reductions, which the compiler otherwise lets the
    # loads wait behind: one more dependent round trip to L2 a layer (sm_90 SASS).
    q_rot = q * q_gain[None, :] if QK_NORM else q
    k_rot = k * k_gain if QK_NORM else k
    q_rot = (
        q_rot * cos[None, :]
        + sign[None, :] * (q_partner * q_gain_partner[None, :] if QK_NORM else q_partner) * sin[None, :]
    )
    k_rot = k_rot * cos + sign * (k_partner * k_gain_partner if QK_NORM else k_partner) * sin
    if QK_NORM:
        q_rot = q_rot / tl.sqrt(tl.sum(q * q, axis=1) / HD + eps)[:, None]
        k_rot = k_rot / tl.sqrt(tl.sum(k * k, axis=0) / HD + eps)
    q_dot = (q_rot * scale_log2e).to(k_cache_ptr.dtype.element_ty)
    k = k_rot

    # The split holding `pos` writes this token into the cache and starts its softmax from it.
    owns = (pos >= lo) & (pos < hi)
    k_cached = k.to(k_cache_ptr.dtype.element_ty)
    v_cached = v.to(v_cache_ptr.dtype.element_ty)
    cur = kv_base + pos * HD + d
    tl.store(k_cache_ptr + cur, k_cached, mask=d_ok & owns & (pos < max_len))
    tl.store(v_cache_ptr + cur, v_cached, mask=d_ok & owns & (pos < max_len))
    s_cur = tl.sum(q_dot.to(tl.float32) * k_cached.to(tl.float32)[None, :], axis=1)  # [BLOCK_H]
    m = tl.where(owns, s_cur, float("-inf"))
    l_sum = tl.where(owns, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.where(owns, v_cached.to(tl.float32)[None, :], 0.0) + tl.zeros([BLOCK_H, HDP], dtype=tl.float32)

    t0 = lo
    while t0 < hi_cached:
        k_blk = k_next
        v_blk = v_next
        t = t0 + tl.arange(0, BLOCK_T)
        t_next = t + BLOCK_T
        next_offs = kv_base + t_next[:, None] * HD + d[None, :]
        next_mask = (t_next < hi_cached)[:, None] & d_ok[None, :]
        k_next = tl.load(k_cache_ptr + next_offs, mask=next_mask, other=0.0, eviction_policy="evict_first")
        v_next = tl.load(v_cache_ptr + next_offs, mask=next_mask, other=0.0, eviction_policy="evict_first")

        s = tl.dot(q_dot, tl.trans(k_blk), input_precision="ieee")  # [BLOCK_H, BLOCK_T]
        s = tl.where((t < hi_cached)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head that has seen no key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(v_cache_ptr.dtype.element_ty), v_blk, input_precision="ieee")  # [BLOCK_H, HDP]
        acc = acc * alpha[:, None] + pv
        m = m_new
        t0 += BLOCK_T

    if not CLUSTER:  # the partials go through global memory
        part = kv * SPLITS + split
        row_ok = heads < GP  # the padding rows beyond GP are not kept
        tl.store(part_o_ptr + (part * GP + heads[:, None]) * HDP + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + (part * 2) * GP + heads, m, mask=row_ok)
        tl.store(part_ml_ptr + (part * 2 + 1) * GP + heads, l_sum, mask=row_ok)
    if PREFETCH_NEXT:  # once this split's own reads are done (see _prefetch_next_block)
        _prefetch_next_block(next_k_ptr, next_v_ptr, kv_base, pos, next_window, split, HD, SPLITS, BLOCK_T)
    group_out = out_ptr + lane * stride_out_lane + kv_in_lane * G * HD
    if CLUSTER:
        _push_merge(acc, m, l_sum, region, armed, split, heads, d, group_out, HD, HDP, G, GP, SPLITS, PUSH_E,
                    PUSH_VEC, PUSH_MLP, THREADS)  # fmt: skip
    else:
        # Every thread's partial is written before one thread publishes it; the last split merges.
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + kv, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            group_rows = tl.arange(0, GP)
            splits = tl.arange(0, SPLITS)
            parts = kv * SPLITS + splits
            ml_offs = (parts[:, None] * 2) * GP + group_rows[None, :]  # [SPLITS, GP]
            ms = tl.load(part_ml_ptr + ml_offs, cache_modifier=".cg")
            ls = tl.load(part_ml_ptr + ml_offs + GP, cache_modifier=".cg")
            m_all = tl.max(ms, axis=0)
            m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
            w = tl.exp2(ms - m_all[None, :])  # [SPLITS, GP]; empty splits weigh 0
            o_offs = (parts[:, None, None] * GP + group_rows[None, :, None]) * HDP + d[None, None, :]
            os = tl.load(part_o_ptr + o_offs, cache_modifier=".cg")
            o = tl.sum(os * w[:, :, None], axis=0) / tl.sum(w * ls, axis=0)[:, None]
            out_offs = lane * stride_out_lane + (kv_in_lane * G + group_rows[:, None]) * HD + d[None, :]
            tl.store(
                out_ptr + out_offs,
                o.to(out_ptr.dtype.element_ty),
                mask=(group_rows < G)[:, None] & d_ok[None, :],
            )
            tl.atomic_xchg(counter_ptr + kv, 0)


# One thread of the program asks L2 for $2 bytes from address $1 (a multiple of 16 bytes, 16-byte aligned).
_BULK_PREFETCH_L2 = tl.constexpr(
    "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.and.u32 p, $2, 0, p; "
    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


@triton.jit
def _prefetch_next_block(next_k_ptr, next_v_ptr, kv_base, pos, next_window, split, HD: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """The first block of cached keys and values this program's split will read in the next layer (the same
    split of the same KV head; the next layer may have another window), asked into L2 now.

    Why the first block only, and after this split's own reads: the whole split range, asked for earlier,
    competes with this layer's own reads at long contexts (qwen3-1.7b: 16 MB a layer), where it lost more than
    it gained at short ones (docs/fast-path.md)."""
    start = tl.where(next_window > 0, tl.maximum(pos - next_window + 1, 0), 0)
    chunk = tl.cdiv(tl.cdiv(pos + 1 - start, SPLITS), BLOCK_T) * BLOCK_T
    lo = start + split * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, pos), lo + BLOCK_T)
    nbytes = (tl.maximum(hi - lo, 0) * HD * next_k_ptr.dtype.element_ty.primitive_bitwidth // 8).to(tl.int32)
    offset = kv_base + lo.to(tl.int64) * HD
    for ptr in tl.static_range(2):
        base = (next_k_ptr if ptr == 0 else next_v_ptr) + offset
        tl.inline_asm_elementwise(_BULK_PREFETCH_L2, "=r,l,r", [base, nbytes], dtype=tl.int32, is_pure=False,
                                  pack=1)  # fmt: skip


@triton.jit
def _push_merge(acc, m, l_sum, region, armed, split, heads, d, out_ptr, HD: tl.constexpr, HDP: tl.constexpr,
                G: tl.constexpr, GP: tl.constexpr, SPLITS: tl.constexpr, E: tl.constexpr, VEC: tl.constexpr,
                MLP: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
    """The cluster merge without global memory or a cluster barrier after the key loop: every split pushes each
    owner its 1/SPLITS of the output elements (and its m, l) straight into the owner's shared memory with
    st.async, which the owner's mbarrier counts in bytes; the owner merges once its inbox is full. What it
    saves against a merge through global memory: the partial stores' GPU-scope release before a cluster barrier
    and the merge's round trip to L2."""
    STAGE_ML: tl.constexpr = 16 + GP * HDP * 4
    INBOX: tl.constexpr = STAGE_ML + MLP * 4
    INBOX_ML: tl.constexpr = INBOX + SPLITS * E * 4
    # 1. The partial in flat (row, dim) order, the order the owners split it in; the padding rows stay out.
    row_ok = heads < GP
    flat = heads[:, None] * HDP + d[None, :]
    store_local(region + 16 + flat * 4, acc, (row_ok[:, None] & (d < HDP)[None, :]).to(tl.int32))
    store_local(region + STAGE_ML + heads * 4, m, row_ok.to(tl.int32))
    store_local(region + STAGE_ML + (GP + heads) * 4, l_sum, row_ok.to(tl.int32))
    tl.debug_barrier()  # every thread's share is staged before any thread pushes
    ready = exchange_ready(armed)
    # 2. Chunks of VEC floats, one a thread (no replication: THREADS elements at least): the o chunks to the
    # owner of their elements, then the m, l block to every owner.
    O_CHUNKS: tl.constexpr = GP * HDP // VEC
    ML_CHUNKS: tl.constexpr = MLP // VEC
    CHUNKS: tl.constexpr = O_CHUNKS + SPLITS * ML_CHUNKS
    # >= CHUNKS (both parts are powers of two) and >= THREADS, a power of two for tl.arange
    SLOTS_MIN: tl.constexpr = 2 * O_CHUNKS if O_CHUNKS >= SPLITS * ML_CHUNKS else 2 * SPLITS * ML_CHUNKS
    SLOTS: tl.constexpr = THREADS if THREADS >= SLOTS_MIN else SLOTS_MIN
    c = tl.arange(0, SLOTS)
    is_o = c < O_CHUNKS
    first = c * VEC  # the chunk's first element (o chunks)
    k = tl.maximum(c - O_CHUNKS, 0)  # the m, l chunk (the others)
    owner = tl.where(is_o, first // E, k // ML_CHUNKS)
    local = tl.where(is_o, 16 + first * 4, STAGE_ML + (k % ML_CHUNKS) * VEC * 4)
    remote = tl.where(
        is_o, INBOX + (split * E + first % E) * 4, INBOX_ML + (split * MLP + (k % ML_CHUNKS) * VEC) * 4
    )
    push(region + local + ready, region + remote, owner, (c < CHUNKS).to(tl.int32), region, VEC)
    # 3. This program's elements, once all SPLITS slices and m, l blocks have landed.
    full = wait_inbox(region)
    e = split * E + tl.arange(0, E)
    row, dim = e // HDP, e % HDP
    src = tl.arange(0, SPLITS)[:, None]
    inbox = region + (full - 1)  # the loads come after the wait
    os = load_local(inbox + INBOX + (src * E + tl.arange(0, E)[None, :]) * 4)  # [SPLITS, E]
    ms = load_local(inbox + INBOX_ML + (src * MLP + row[None, :]) * 4)
    ls = load_local(inbox + INBOX_ML + (src * MLP + GP + row[None, :]) * 4)
    m_all = tl.max(ms, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(ms - m_all[None, :])  # [SPLITS, E]; empty splits weigh 0
    o = tl.sum(os * w, axis=0) / tl.sum(w * ls, axis=0)
    tl.store(out_ptr + row * HD + dim, o.to(out_ptr.dtype.element_ty), mask=(row < G) & (dim < HD))


def push_layout(group: int, head_dim: int, splits: int) -> tuple[int, int, int, int]:
    """The push merge's (E, VEC, MLP, bytes): E output elements a program merges, pushed VEC floats at a time;
    m and l as 2 x GP floats padded to MLP; and the shared memory a program takes past the kernel's own. The
    region: an mbarrier (16 bytes); the program's partial staged (o as [GP, HDP] fp32, then m, l in MLP
    floats); the inbox (o slices as [SPLITS sources, E], then m, l as [SPLITS sources, MLP]); 16 bytes of slack
    to align it."""
    gp, hdp = triton.next_power_of_2(group), padded_head_dim(head_dim)
    e = gp * hdp // splits
    vec = min(4, e)
    mlp = max(2 * gp, vec)
    return e, vec, mlp, 16 + (gp * hdp + mlp) * 4 + splits * (e + mlp) * 4 + 16


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot reduces over at least 16


class AttentionScratch:
    """Partials and counters of the split-KV merge, allocated once per model (counters start at, and return
    to, zero)."""

    def __init__(self, num_kv_heads: int, group: int, head_dim: int, splits: int, device: torch.device):
        if splits < 1 or splits & (splits - 1):
            raise ValueError(
                f"splits: expected a power of two (the merge spans them with tl.arange), got {splits}"
            )
        gp, hdp = triton.next_power_of_2(group), padded_head_dim(head_dim)
        self.splits = splits
        self.part_o = torch.empty(num_kv_heads, splits, gp, hdp, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(num_kv_heads, splits, 2, gp, dtype=torch.float32, device=device)
        self.counter = torch.zeros(num_kv_heads, dtype=torch.int32, device=device)


def prefetch_next_possible(k_cache: torch.Tensor) -> bool:
    """Whether decode_attention can take next_layer for this cache: the bulk prefetch is sm_90's and moves
    16-byte multiples from 16-byte aligned addresses (a cache row, hd elements, must be a multiple of 16 B)."""
    return hopper_features(k_cache.device) and k_cache.shape[-1] * k_cache.element_size() % 16 == 0


def default_splits(num_kv_heads: int, multiprocessors: int) -> int:
    """Enough (power-of-two) splits that the KV heads together fill the multiprocessors (sm_count) once."""
    splits = 1
    while splits * 2 * num_kv_heads <= multiprocessors and splits < 64:
        splits *= 2
    return splits


def decode_attention(
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
    window: int | None = None,
    interleaved: bool = True,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    use_pdl: bool = False,
    block_t: int = 64,
    num_warps: int | None = None,
    next_layer: tuple[torch.Tensor, torch.Tensor, int | None] | None = None,
) -> torch.Tensor:
    """Attention of the token at position pos[0] (a device int tensor) over the cache, writing its k, v there.

    qkv: [L, (H/L + 2 KV/L) * hd]: per lane this token's q heads, then k heads, then v heads (before RoPE).
    k_cache, v_cache: [KV, max_len, hd] of this layer. cos, sin: [max_positions, hd/2] fp32.
    out: [L, H/L * hd]. q_norm, k_norm: [hd] (Qwen3). scratch: from AttentionScratch for this model.
    num_warps: None picks 4, except 2 for head dims up to 64 with the counter merge (the cluster merge spreads
    its last step over the threads, so it keeps 4).
    The splits merge in a thread-block cluster wherever one can run (a Hopper GPU, at most 16 splits), else
    through an arrival counter.
    next_layer: (k_cache, v_cache, window) of the next layer, or None. Given, each program asks L2 (a bulk
    prefetch, sm_90), once its own reads are done, for the first block of cached keys and values its split
    will read in the next layer: that launch's first block, loaded before its wait, then comes from L2, not HBM.
    The bytes are the ones the next layer reads anyway, asked for while this layer's merge leaves the memory
    idle. Needs a Hopper GPU and cache rows of a multiple of 16 bytes (prefetch_next_possible).
    """
    if (
        k_cache.dim() != 3
        or k_cache.shape != v_cache.shape
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        raise ValueError(
            f"k_cache: expected contiguous [KV, max_len, hd] like v_cache, got {tuple(k_cache.shape)}"
        )
    num_kv, max_len, hd = k_cache.shape
    lanes = qkv.shape[0]
    if num_heads % num_kv or num_heads % lanes or num_kv % lanes:
        raise ValueError(
            f"num_heads: {num_heads} must be a multiple of the KV heads ({num_kv}) and lanes ({lanes})"
        )
    heads_per_lane, kv_per_lane = num_heads // lanes, num_kv // lanes
    if qkv.dim() != 2 or qkv.shape[1] != (heads_per_lane + 2 * kv_per_lane) * hd or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv: expected [{lanes}, {(heads_per_lane + 2 * kv_per_lane) * hd}], got {tuple(qkv.shape)}"
        )
    if out.shape != (lanes, heads_per_lane * hd) or out.stride(1) != 1:
        raise ValueError(f"out: expected [{lanes}, {heads_per_lane * hd}], got {tuple(out.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != hd // 2 or cos.dtype != torch.float32:
        raise ValueError(f"cos: expected fp32 [max_positions, {hd // 2}] like sin, got {tuple(cos.shape)}")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pos: expected one int32/int64 element, got {pos.dtype} {tuple(pos.shape)}")
    if (q_norm is None) != (k_norm is None) or (
        q_norm is not None and (q_norm.shape != (hd,) or k_norm.shape != (hd,))
    ):
        raise ValueError(f"q_norm: expected q_norm and k_norm both [{hd}] or both None")
    group = num_heads // num_kv
    if scratch.part_o.shape[:3] != (num_kv, scratch.splits, triton.next_power_of_2(group)):
        raise ValueError("scratch: allocated for another head layout")

    # one split has nothing to merge: a cluster of one program would arm and wait on an inbox nobody fills
    cluster = hopper_features(k_cache.device) and scratch.splits > 1 and scratch.splits in CLUSTER_SIZES
    if num_warps is None:
        num_warps = 2 if padded_head_dim(hd) <= 64 and not cluster else 4
    push_e, push_vec, push_mlp, push_bytes = (
        push_layout(group, hd, scratch.splits) if cluster else (0, 0, 0, 0)
    )
    if next_layer is not None:
        if any(
            t.shape != k_cache.shape or not t.is_contiguous() or t.data_ptr() % 16 for t in next_layer[:2]
        ):
            raise ValueError(f"next_layer: expected contiguous, 16-byte aligned caches shaped like this layer's "
                             f"{tuple(k_cache.shape)}, got {tuple(next_layer[0].shape)} and "
                             f"{tuple(next_layer[1].shape)}")  # fmt: skip
        if not prefetch_next_possible(k_cache):
            raise ValueError("next_layer: the L2 prefetch needs a Hopper GPU and cache rows of a multiple of 16 "
                             f"bytes (got {hd * k_cache.element_size()})"
                             + (" (under the interpreter)" if interpreted() else ""))  # fmt: skip
    next_k, next_v, next_window = next_layer if next_layer is not None else (k_cache, v_cache, None)
    args = (
        qkv,
        qkv.stride(0),
        k_cache,
        v_cache,
        pos,
        cos,
        sin,
        q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos,
        scratch.part_o,
        scratch.part_ml,
        scratch.counter,
        out,
        out.stride(0),
        next_k,
        next_v,
        heads_per_lane,
        kv_per_lane,
        window or 0,
        next_window or 0,
        max_len,
        hd**-0.5 * 1.4426950408889634,
        eps,
    )
    options = dict(
        HD=hd,
        HDP=padded_head_dim(hd),
        G=group,
        GP=triton.next_power_of_2(group),
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        SPLITS=scratch.splits,
        BLOCK_T=block_t,
        INTERLEAVED=interleaved,
        QK_NORM=q_norm is not None,
        CLUSTER=cluster,
        PUSH_E=push_e,
        PUSH_VEC=push_vec,
        PUSH_MLP=push_mlp,
        PUSH_BYTES=push_bytes,
        THREADS=32 * num_warps,
        USE_PDL=use_pdl,
        PREFETCH_NEXT=next_layer is not None,
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    if cluster:
        launch_clusters(
            _decode_attention_kernel, num_kv, scratch.splits, args, options, exchange_bytes=push_bytes
        )
    else:
        _decode_attention_kernel[(num_kv, scratch.splits)](*args, **options)
    return out
