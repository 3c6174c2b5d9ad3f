"""decode_attention's step (kernels/decode_attention.py) written in Gluon, with every layout chosen so that the
loop over a split's keys has no barrier across warps: a probe of whether the attention's chain gets shorter.

Round 19 (kernels/NOTES.md) timed the Triton kernel from inside: half of what follows its wait is one block of
64 keys (RoPE'd q against the keys, the softmax, the values), whose two tl.dot products stage their operands
through shared memory, and whose row max and sum cross the 4 warps: 12 CTA barriers in the loop, 6 before it.
Triton picks its own layouts; a broadcast-and-sum on the CUDA cores instead of tl.dot puts the head dim across
the warps (67 barriers, .carry/attn_compile.py). Gluon lets the kernel say where each element lives:

    L4 over [W warps, GP query heads, TW keys a warp, HDP dims]: warps split the block's keys, each thread
    holds 8 consecutive dims (one 16-byte load) of TW / TL keys, DL lanes span the head dim, TL lanes the keys.

So q . k sums over registers and DL lanes (shuffles), the softmax's max and sum over a warp's own keys run
over registers and TL lanes, and p @ v sums over the same: every reduction of the loop stays inside a warp.
Each warp keeps its own running (max, sum, output) for its keys, as if it were a split of its own, and the W
warps are merged once after the loop (the only reduction across warps, through shared memory). The products
run on the CUDA cores in fp32; a step's block is GP x 64 x HDP multiply-adds twice, ~2 x 16K, which the
tensor cores do not need.

Everything else is the Triton kernel's: the same arguments, the partials in the same scratch, the cluster merge
after a cluster barrier, the L2 prefetch of the next layer's first block, PDL. Hopper only (clusters); the
interpreter cannot run Gluon, so CPU tests keep to the Triton kernel and the GPU tests compare the two.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_CLUSTER_SYNC = gl.constexpr(
    "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, $1;"
)
_BULK_PREFETCH_L2 = gl.constexpr(
    "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.and.u32 p, $2, 0, p; "
    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)


@gluon.jit
def _rope_pairing(d, HD: gl.constexpr, INTERLEAVED: gl.constexpr):
    if INTERLEAVED:
        return d ^ 1, d // 2, d % 2 == 0
    else:
        half = d < HD // 2
        return gl.where(half, d + HD // 2, d - HD // 2), gl.where(half, d, d - HD // 2), half


@gluon.jit
def _decode_attention_warps_kernel(
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
    HD: gl.constexpr,
    HDP: gl.constexpr,
    G: gl.constexpr,
    GP: gl.constexpr,
    SPLITS: gl.constexpr,
    BLOCK_T: gl.constexpr,
    INTERLEAVED: gl.constexpr,
    QK_NORM: gl.constexpr,
    USE_PDL: gl.constexpr,
    PREFETCH_NEXT: gl.constexpr,
    KV_CACHE: gl.constexpr,
    KV_EVICT: gl.constexpr,
    PROBE: gl.constexpr = 0,
):
    W: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 8  # dims a thread loads at once: 16 bytes of bf16
    DL: gl.constexpr = HDP // VEC  # lanes across the head dim (<= 32)
    TL: gl.constexpr = 32 // DL  # lanes across a warp's keys
    TW: gl.constexpr = BLOCK_T // W  # keys a warp takes of each block
    L4: gl.constexpr = gl.BlockedLayout([1, GP, 1, VEC], [1, 1, TL, DL], [W, 1, 1, 1], [3, 2, 1, 0])
    S3: gl.constexpr = gl.SliceLayout(3, L4)  # [W, GP, TW] scores
    O3: gl.constexpr = gl.SliceLayout(2, L4)  # [W, GP, HDP] a warp's output
    C3: gl.constexpr = gl.SliceLayout(1, L4)  # [W, TW, HDP] a block of the cache
    WG: gl.constexpr = gl.SliceLayout(2, S3)  # [W, GP] a warp's max and sum, beside the scores
    WGO: gl.constexpr = gl.SliceLayout(2, O3)  # [W, GP] the same, beside the output
    QL: gl.constexpr = gl.SliceLayout(0, O3)  # [GP, HDP] q
    DV: gl.constexpr = gl.SliceLayout(0, QL)  # [HDP] this token's k and v, cos, sin
    HV: gl.constexpr = gl.SliceLayout(1, QL)  # [GP]

    kv = gl.program_id(0) // SPLITS  # one cluster of SPLITS programs a KV head
    split = gl.program_id(0) % SPLITS
    lane = kv // kv_per_lane
    kv_in_lane = kv % kv_per_lane
    d = gl.arange(0, HDP, layout=DV)
    d_ok = d < HD
    partner, pair, first = _rope_pairing(d, HD, INTERLEAVED)
    sign = gl.where(first, -1.0, 1.0)
    heads = gl.arange(0, GP, layout=HV)
    head_ok = heads < G

    pos = gl.load(pos_ptr, cache_modifier=".cg")
    start = gl.where(window > 0, gl.maximum(pos - window + 1, 0), 0)
    n_keys = pos + 1 - start
    chunk = gl.cdiv(gl.cdiv(n_keys, SPLITS), BLOCK_T) * BLOCK_T
    lo = start + split * chunk
    hi = gl.minimum(lo + chunk, pos + 1)
    hi_cached = gl.minimum(hi, pos)
    kv_base = kv.to(gl.int64) * max_len * HD

    # A block's keys as [W, TW] (warp w takes keys w * TW ..), with the dims, in the cache's layout C3.
    cw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, C3)))
    cj = gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(2, C3)))
    cd = gl.arange(0, HDP, layout=gl.SliceLayout(0, gl.SliceLayout(0, C3)))
    c_key = gl.expand_dims(gl.expand_dims(cw * TW, 1) + gl.expand_dims(cj, 0), 2)  # [W, TW, 1]
    c_dim = gl.expand_dims(gl.expand_dims(cd, 0), 0)  # [1, 1, HDP]
    c_dim_ok = c_dim < HD
    # The same keys beside the scores (S3), for the mask.
    sw = gl.arange(0, W, layout=gl.SliceLayout(1, WG))
    sj = gl.arange(0, TW, layout=gl.SliceLayout(0, gl.SliceLayout(1, S3)))
    s_key = gl.expand_dims(gl.expand_dims(sw * TW, 1), 2) + gl.expand_dims(
        gl.expand_dims(sj, 0), 1
    )  # [W, 1, TW]

    t = lo + c_key
    kv_offs = kv_base + t * HD + c_dim
    kv_mask = (t < hi_cached) & c_dim_ok
    k_next = gl.load(
        k_cache_ptr + kv_offs, mask=kv_mask, other=0.0, cache_modifier=KV_CACHE, eviction_policy=KV_EVICT
    )
    v_next = gl.load(
        v_cache_ptr + kv_offs, mask=kv_mask, other=0.0, cache_modifier=KV_CACHE, eviction_policy=KV_EVICT
    )
    if QK_NORM:
        q_gain = gl.load(q_norm_ptr + d, mask=d_ok, other=0.0).to(gl.float32)
        q_gain_partner = gl.load(q_norm_ptr + partner, mask=d_ok, other=0.0).to(gl.float32)
        k_gain = gl.load(k_norm_ptr + d, mask=d_ok, other=0.0).to(gl.float32)
        k_gain_partner = gl.load(k_norm_ptr + partner, mask=d_ok, other=0.0).to(gl.float32)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()

    lane_qkv = qkv_ptr + lane * stride_qkv_lane
    q_rows = lane_qkv + gl.expand_dims(kv_in_lane * G + heads, 1) * HD  # [GP, 1]
    q_mask = gl.expand_dims(head_ok, 1) & gl.expand_dims(d_ok, 0)
    q = gl.load(q_rows + gl.expand_dims(d, 0), mask=q_mask, other=0.0).to(gl.float32)
    q_partner = gl.load(q_rows + gl.expand_dims(partner, 0), mask=q_mask, other=0.0).to(gl.float32)
    k_row = lane_qkv + (heads_per_lane + kv_in_lane) * HD
    k = gl.load(k_row + d, mask=d_ok, other=0.0).to(gl.float32)
    k_partner = gl.load(k_row + partner, mask=d_ok, other=0.0).to(gl.float32)
    v_row = lane_qkv + (heads_per_lane + kv_per_lane + kv_in_lane) * HD
    v = gl.load(v_row + d, mask=d_ok, other=0.0)
    cos = gl.load(cos_ptr + pos * (HD // 2) + pair, mask=d_ok, other=0.0)
    sin = gl.load(sin_ptr + pos * (HD // 2) + pair, mask=d_ok, other=0.0)
    if QK_NORM:  # the gains before RoPE, 1 / rms after it (as the Triton kernel)
        q_rot = q * gl.expand_dims(q_gain, 0)
        q_rot = q_rot * gl.expand_dims(cos, 0) + gl.expand_dims(sign * sin, 0) * (
            q_partner * gl.expand_dims(q_gain_partner, 0)
        )
        k_rot = k * k_gain * cos + sign * (k_partner * k_gain_partner) * sin
        q_rot = q_rot / gl.expand_dims(gl.sqrt(gl.sum(q * q, axis=1) / HD + eps), 1)
        k_rot = k_rot / gl.sqrt(gl.sum(k * k, axis=0) / HD + eps)
    else:
        q_rot = q * gl.expand_dims(cos, 0) + gl.expand_dims(sign * sin, 0) * q_partner
        k_rot = k * cos + sign * k_partner * sin
    # q rounded to the cache's dtype, as the Triton kernel's tl.dot operand, then held in fp32
    q_dot = (q_rot * scale_log2e).to(k_cache_ptr.dtype.element_ty).to(gl.float32)  # [GP, HDP]

    owns = (pos >= lo) & (pos < hi)
    k_cached = k_rot.to(k_cache_ptr.dtype.element_ty)
    v_cached = v.to(v_cache_ptr.dtype.element_ty)
    cur = kv_base + pos * HD + d
    gl.store(k_cache_ptr + cur, k_cached, mask=d_ok & owns & (pos < max_len))
    gl.store(v_cache_ptr + cur, v_cached, mask=d_ok & owns & (pos < max_len))
    s_cur = gl.sum(q_dot * gl.expand_dims(k_cached.to(gl.float32), 0), axis=1)  # [GP]
    # The token's own key starts warp 0's softmax; the other warps start empty.
    own = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, WGO)) == 0, 1) & owns  # [W, 1]
    m = gl.where(own, gl.expand_dims(gl.convert_layout(s_cur, gl.SliceLayout(0, WGO)), 0), float("-inf"))
    l_sum = gl.where(own, 1.0, 0.0) + gl.zeros([W, GP], gl.float32, layout=WGO)
    acc = gl.where(
        gl.expand_dims(own, 2), gl.expand_dims(gl.expand_dims(v_cached.to(gl.float32), 0), 0), 0.0
    ) + gl.zeros([W, GP, HDP], gl.float32, layout=O3)
    m = gl.convert_layout(m, WG)
    l_sum = gl.convert_layout(l_sum, WG)
    q4 = gl.expand_dims(gl.expand_dims(q_dot, 0), 2)  # [1, GP, 1, HDP] in L4

    t0 = lo
    if PROBE >= 1:  # timing probe: no keys read past the first block's loads
        t0 = hi_cached
    while t0 < hi_cached:
        k_blk = k_next.to(gl.float32)
        v_blk = v_next.to(gl.float32)
        t_next = t0 + BLOCK_T + c_key
        next_offs = kv_base + t_next * HD + c_dim
        next_mask = (t_next < hi_cached) & c_dim_ok
        k_next = gl.load(k_cache_ptr + next_offs, mask=next_mask, other=0.0, cache_modifier=KV_CACHE,
                         eviction_policy=KV_EVICT)  # fmt: skip
        v_next = gl.load(v_cache_ptr + next_offs, mask=next_mask, other=0.0, cache_modifier=KV_CACHE,
                         eviction_policy=KV_EVICT)  # fmt: skip

        s = gl.sum(q4 * gl.expand_dims(k_blk, 1), axis=3)  # [W, GP, TW]: within each warp
        s = gl.where(t0 + s_key < hi_cached, s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=2))  # [W, GP]
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp that has seen no key yet
        alpha = gl.exp2(m - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 2))
        l_sum = l_sum * alpha + gl.sum(p, axis=2)
        # p rounded to the cache's dtype as the Triton kernel's tl.dot operand
        p = p.to(v_cache_ptr.dtype.element_ty).to(gl.float32)
        pv = gl.sum(gl.expand_dims(p, 3) * gl.expand_dims(v_blk, 1), axis=2)  # [W, GP, HDP]
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, WGO), 2) + pv
        m = m_new
        t0 += BLOCK_T

    # The warps' partials merged: the one exchange across warps, through shared memory (one barrier), then
    # each thread merges its elements from all W warps in its own registers.
    SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    acc_smem = gl.allocate_shared_memory(gl.float32, [W, GP, HDP], SH, acc)
    SH2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    m_smem = gl.allocate_shared_memory(gl.float32, [W, GP], SH2, m)
    l_smem = gl.allocate_shared_memory(gl.float32, [W, GP], SH2, l_sum)
    gl.thread_barrier()
    MR: gl.constexpr = gl.BlockedLayout([W, 1, 1], [1, 1, 32], [1, 1, W], [2, 1, 0])  # [W, GP, HDP]
    acc_w = acc_smem.load(MR)
    m_w = m_smem.load(gl.SliceLayout(2, MR))  # [W, GP]
    l_w = l_smem.load(gl.SliceLayout(2, MR))
    m_raw = gl.max(m_w, axis=0)  # [GP]
    m_all = gl.where(m_raw == float("-inf"), 0.0, m_raw)
    w_scale = gl.exp2(m_w - gl.expand_dims(m_all, 0))  # [W, GP]; empty warps weigh 0
    l_all = gl.sum(l_w * w_scale, axis=0)
    o = gl.sum(acc_w * gl.expand_dims(w_scale, 2), axis=0)  # [GP, HDP]

    part = kv * SPLITS + split
    OL: gl.constexpr = gl.SliceLayout(0, MR)
    o_heads = gl.arange(0, GP, layout=gl.SliceLayout(1, OL))
    o_dims = gl.arange(0, HDP, layout=gl.SliceLayout(0, OL))
    gl.store(part_o_ptr + gl.expand_dims((part * GP + o_heads) * HDP, 1) + gl.expand_dims(o_dims, 0), o)
    ml_heads = gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, MR)))
    gl.store(part_ml_ptr + (part * 2) * GP + ml_heads, m_raw)
    gl.store(part_ml_ptr + (part * 2 + 1) * GP + ml_heads, l_all)
    if PREFETCH_NEXT:
        _prefetch_next_block(next_k_ptr, next_v_ptr, kv_base, pos, next_window, split, HD, SPLITS, BLOCK_T)
    if PROBE >= 2:  # timing probe: no merge; split 0 writes its own partial as the output
        if split == 0:
            gl.store(out_ptr + lane * stride_out_lane + kv_in_lane * G * HD
                     + gl.expand_dims(o_heads * HD, 1) + gl.expand_dims(o_dims, 0),
                     (o / gl.expand_dims(gl.convert_layout(gl.maximum(l_all, 1.0), gl.SliceLayout(1, OL)), 1)).to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(o_heads < G, 1) & gl.expand_dims(o_dims < HD, 0))  # fmt: skip
    else:
        _cluster_merge(
            part_o_ptr,
            part_ml_ptr,
            kv,
            split,
            out_ptr + lane * stride_out_lane + kv_in_lane * G * HD,
            HD,
            HDP,
            G,
            GP,
            SPLITS,
            W,
        )


@gluon.jit
def _prefetch_next_block(next_k_ptr, next_v_ptr, kv_base, pos, next_window, split, HD: gl.constexpr,
                         SPLITS: gl.constexpr, BLOCK_T: gl.constexpr):  # fmt: skip
    """kernels/decode_attention.py's _prefetch_next_block."""
    start = gl.where(next_window > 0, gl.maximum(pos - next_window + 1, 0), 0)
    chunk = gl.cdiv(gl.cdiv(pos + 1 - start, SPLITS), BLOCK_T) * BLOCK_T
    lo = start + split * chunk
    hi = gl.minimum(gl.minimum(lo + chunk, pos), lo + BLOCK_T)
    nbytes = (gl.maximum(hi - lo, 0) * HD * next_k_ptr.dtype.element_ty.primitive_bitwidth // 8).to(gl.int32)
    offset = kv_base + lo.to(gl.int64) * HD
    gl.inline_asm_elementwise(_BULK_PREFETCH_L2, "=r,l,r", [next_k_ptr + offset, nbytes], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip
    gl.inline_asm_elementwise(_BULK_PREFETCH_L2, "=r,l,r", [next_v_ptr + offset, nbytes], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _cluster_merge(part_o_ptr, part_ml_ptr, kv, split, out_ptr, HD: gl.constexpr, HDP: gl.constexpr,
                   G: gl.constexpr, GP: gl.constexpr, SPLITS: gl.constexpr, W: gl.constexpr):  # fmt: skip
    """kernels/decode_attention.py's _cluster_merge: after the cluster barrier, program `split` merges its
    1/SPLITS of the head group's output elements from every split's partial."""
    ready = gl.inline_asm_elementwise(
        _CLUSTER_SYNC, "=r,r", [split * 0], dtype=gl.int32, is_pure=False, pack=1
    )
    E: gl.constexpr = GP * HDP // SPLITS
    SL: gl.constexpr = SPLITS if SPLITS < 32 else 32  # the splits across lanes: the sums stay in a warp
    ML: gl.constexpr = gl.BlockedLayout([1, 1], [SL, 32 // SL], [1, W], [1, 0])  # [SPLITS, E]
    e = split * E + gl.arange(0, E, layout=gl.SliceLayout(0, ML))
    row, dim = e // HDP, e % HDP
    parts = kv * SPLITS + gl.expand_dims(gl.arange(0, SPLITS, layout=gl.SliceLayout(1, ML)), 1) + ready
    ml_offs = (parts * 2) * GP + gl.expand_dims(row, 0)  # [SPLITS, E]
    ms = gl.load(part_ml_ptr + ml_offs, cache_modifier=".cg")
    ls = gl.load(part_ml_ptr + ml_offs + GP, cache_modifier=".cg")
    os = gl.load(part_o_ptr + (parts * GP + gl.expand_dims(row, 0)) * HDP + gl.expand_dims(dim, 0),
                 cache_modifier=".cg")  # fmt: skip
    m_all = gl.max(ms, axis=0)
    m_all = gl.where(m_all == float("-inf"), 0.0, m_all)
    w = gl.exp2(ms - gl.expand_dims(m_all, 0))
    o = gl.sum(os * w, axis=0) / gl.sum(w * ls, axis=0)
    gl.store(out_ptr + row * HD + dim, o.to(out_ptr.dtype.element_ty), mask=(row < G) & (dim < HD))
