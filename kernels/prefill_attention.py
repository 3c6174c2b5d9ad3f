"""Prefill attention: causal (optionally sliding-window) flash attention over a whole prompt, GQA, reading q
straight from the q|k|v matmul output and writing the heads in the layout the o-proj matmul reads.

For query head h (lane l = h // (H/L), head j = h % (H/L) of that lane, KV head g = h // G, G = H/KV) and
row r < T of the prompt's part at position p = start + r (start > 0: after a reused prefix, whose keys and
values the cache holds already):
    q = rope(qknorm(qkv[l, r, j]), p)          (rounded to the input dtype, as model.py rounds it)
    out[l, r, j] = softmax_t(q . k_t * hd^-0.5) @ v_t   over t in [p - W + 1, p] (window W) or [0, p]
with k_t, v_t the cache rows [g, t] that kernels/prefill_kv_write.py writes first (rotated once: see there
why). The launcher runs both: the cache write, then this kernel. Softmax online in fp32 (exp2, the
log2(e) folded into the scale); both products on the tensor cores (tl.dot, fp32 accumulation).

Grid: (H, cdiv(T, BLOCK_M), SPLITS). A program owns BLOCK_M positions of one query head, holds its rotated q
block in registers and streams the key/value blocks its rows can see (its split's share of them). Key blocks
that the window or causality masks entirely are never visited; blocks wholly visible to every row run without
a mask, only the blocks that straddle the diagonal or the window's lower edge build one. tl.dot takes
power-of-two sizes, so a head dim like 96 is split in two parts (64 + 32: head_dim_parts) rather than padded to
128, which would waste a quarter of the tensor-core work; a remainder under 16 pads instead. Heads vary fastest
in the grid, so the G query heads of a KV head run side by side and share its cache blocks in L2; query blocks
run last-first, so the longest programs (the most keys) start first and the short ones fill the tail.

A few rows after many keys (a speculative verify step, a short suffix after a reused prefix) make too few
programs to fill the GPU, each a long chain of dependent block reads. There the keys are split too
(flash-decoding): each of SPLITS programs of a query block streams a contiguous share of its key blocks and
stores its unnormalised partial (acc, max, sum) in fp32, and _merge_splits_kernel combines them into the heads.

Work (laneformer-2b, T = 4,094, bf16): q . k and p @ v are 4 * hd FLOPs per (query, visible key) pair per
head: 5 causal layers * 32 heads * 8.38 M pairs + 10 windowed layers (W = 2,048) * 32 heads * 6.29 M pairs
= 1.29 TFLOP at hd 96 (+~4% for the masked halves of the diagonal and window-edge blocks): the kernel is
bound by the tensor cores, not by bytes.
Bytes: q read once and the output written once (25 MB each a layer), keys and values from L2 (each KV block
is read by the G heads of every query block that sees it; the 25 MB cache of a layer fits in L2).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs, sm_count
from kernels.prefill_kv_write import (
    check_prefill_layout,
    head_rstd,
    launch_prefill_kv_write,
    rope_rows,
    start_args,
)

LOG2E = 1.4426950408889634
# keys a split takes at least: a query block seeing fewer keys than twice this stays one pass
SPLIT_KEYS = 256


@triton.jit
def _attend_block(
    acc_a,
    acc_b,
    m_i,
    l_i,
    q_a,
    q_b,
    k_ptr,
    v_ptr,
    p_rows,
    n0,
    T,
    window,
    scale_log2e,
    HD: tl.constexpr,
    HDA: tl.constexpr,
    HDB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One step of the online softmax: the keys n0 .. n0 + BLOCK_N - 1 of one KV head (k_ptr, v_ptr: its cache
    rows [max_len, HD]).

    The head dims are in two parts, [0, HDA) and [HDA, HDA + HDB) (HDB = 0: one part, HDA >= HD padded):
    q_a [BLOCK_M, HDA], q_b [BLOCK_M, HDB] the rotated queries; acc_a, acc_b the running outputs (fp32);
    m_i, l_i [BLOCK_M] the running maximum (log2 units) and sum of the rows at positions p_rows [BLOCK_M].
    MASKED: the block straddles the diagonal or the window's edge (a row may see none of its keys, so a
    maximum may still be -inf); otherwise every key is visible to every row and no mask is built."""
    t = n0 + tl.arange(0, BLOCK_N)
    rows = t[:, None] * HD  # [BLOCK_N, 1]
    da = tl.arange(0, HDA)
    mask_a = (da < HD)[None, :]
    if MASKED:
        mask_a = (t < T)[:, None] & mask_a
    k_a = tl.load(k_ptr + rows + da[None, :], mask=mask_a, other=0.0)
    s = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    if HDB > 0:
        db = HDA + tl.arange(0, HDB)
        mask_b = (db < HD)[None, :]
        if MASKED:
            mask_b = (t < T)[:, None] & mask_b
        k_b = tl.load(k_ptr + rows + db[None, :], mask=mask_b, other=0.0)
        s = tl.dot(q_b, tl.trans(k_b), acc=s, input_precision="ieee")
    s = s * scale_log2e  # log2 units
    if MASKED:
        seen = (t[None, :] <= p_rows[:, None]) & (t[None, :] > p_rows[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(k_a.dtype)
    v_a = tl.load(v_ptr + rows + da[None, :], mask=mask_a, other=0.0)
    acc_a = acc_a * alpha[:, None] + tl.dot(p, v_a, input_precision="ieee")
    if HDB > 0:
        v_b = tl.load(v_ptr + rows + db[None, :], mask=mask_b, other=0.0)
        acc_b = acc_b * alpha[:, None] + tl.dot(p, v_b, input_precision="ieee")
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _attend(
    acc_a,
    acc_b,
    m_i,
    l_i,
    q_a,
    q_b,
    k_ptr,
    v_ptr,
    p_rows,
    start,
    end,
    T,
    window,
    scale_log2e,
    HD: tl.constexpr,
    HDA: tl.constexpr,
    HDB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    FOR_LOOP: tl.constexpr,
):
    """_attend_block over the key blocks [start, end). A `for` loop on the GPU, where Triton pipelines it (the
    next blocks' loads in flight during this one's products); the interpreter cannot take tensor bounds in
    range(), so there it is a while loop over the same body."""
    if FOR_LOOP:
        for n0 in range(start, end, BLOCK_N):
            acc_a, acc_b, m_i, l_i = _attend_block(acc_a, acc_b, m_i, l_i, q_a, q_b, k_ptr, v_ptr, p_rows, n0, T,
                                                   window, scale_log2e, HD, HDA, HDB, BLOCK_N, MASKED)  # fmt: skip
    else:
        n0 = start
        while n0 < end:
            acc_a, acc_b, m_i, l_i = _attend_block(acc_a, acc_b, m_i, l_i, q_a, q_b, k_ptr, v_ptr, p_rows, n0, T,
                                                   window, scale_log2e, HD, HDA, HDB, BLOCK_N, MASKED)  # fmt: skip
            n0 += BLOCK_N
    return acc_a, acc_b, m_i, l_i


@triton.jit(do_not_specialize=["start"])  # a reused prefix's length varies: no compile per its divisibility
def _prefill_attention_kernel(
    qkv_ptr,
    stride_qkv_lane,
    stride_qkv_t,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    out_ptr,
    stride_out_lane,
    stride_out_t,
    part_o_ptr,
    part_ml_ptr,
    T,
    start,
    start_ptr,
    heads_per_lane,
    group,
    max_len,
    window,
    scale_log2e,
    eps,
    HD: tl.constexpr,
    HDP: tl.constexpr,
    HDA: tl.constexpr,
    HDB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QK_NORM: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    START_PTR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # every program waits: the chain of dependencies stays transitive
        gdc_wait()
        gdc_launch_dependents()
    if START_PTR:  # a graph's replays: the host writes start into a device scalar before each
        start = tl.load(start_ptr).to(tl.int32)
    head = tl.program_id(0)
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # last query block first
    total = start + T  # keys 0 .. total - 1 are in the cache
    window = tl.minimum(window, total)  # a window at least as long as the prompt is plain causal
    p0, hi_pos, lo, hi = _key_blocks(start, m0, T, window, BLOCK_M, BLOCK_N)
    # Key blocks: [lo, full_lo) and [full_hi, hi) need a mask, [full_lo, full_hi) is visible to every row.
    # the first block past the last real row's window start
    full_lo = (tl.maximum(hi_pos - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum((p0 + 1) // BLOCK_N * BLOCK_N, hi), full_lo)
    split, used = 0, 1
    if SPLITS > 1:  # this program's share of the key blocks becomes [lo, hi), each segment cut to it
        split = tl.program_id(2)
        used = _used_splits(lo, hi, SPLIT_KEYS, SPLITS)
        chunk = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), used) * BLOCK_N
        lo = tl.minimum(lo + split * chunk, hi)
        hi = tl.minimum(lo + chunk, hi)
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    if split < used:  # the splits past `used` have no keys: nothing to do, the merge skips them
        lane = head // heads_per_lane
        j = head % heads_per_lane
        kv = head // group
        r_rows = m0 + tl.arange(0, BLOCK_M)  # rows of qkv and out
        row_ok = r_rows < T
        p_rows = start + r_rows  # their positions

        # This block's queries, normed and rotated once, in the input dtype for tl.dot: [BLOCK_M, HDA], [.., HDB].
        q_cols = qkv_ptr + lane.to(tl.int64) * stride_qkv_lane + j * HD
        q_rows = r_rows * stride_qkv_t
        rstd = eps  # unused without the norm
        if QK_NORM:
            rstd = head_rstd(q_cols, q_rows, row_ok, eps, HD, HDP)
        dtype = k_cache_ptr.dtype.element_ty
        q_a = rope_rows(q_cols, q_rows, row_ok, p_rows, cos_ptr, sin_ptr, q_norm_ptr, rstd, HD, 0, HDA,
                        INTERLEAVED, QK_NORM).to(dtype)  # fmt: skip
        acc_a = tl.zeros([BLOCK_M, HDA], dtype=tl.float32)
        if HDB > 0:
            q_b = rope_rows(q_cols, q_rows, row_ok, p_rows, cos_ptr, sin_ptr, q_norm_ptr, rstd, HD, HDA, HDB,
                            INTERLEAVED, QK_NORM).to(dtype)  # fmt: skip
            acc_b = tl.zeros([BLOCK_M, HDB], dtype=tl.float32)
        else:
            q_b = q_a  # unused
            acc_b = tl.zeros([1], dtype=tl.float32)  # unused

        cache = kv.to(tl.int64) * max_len * HD
        k_ptr = k_cache_ptr + cache
        v_ptr = v_cache_ptr + cache
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_a, acc_b, m_i, l_i = _attend(acc_a, acc_b, m_i, l_i, q_a, q_b, k_ptr, v_ptr, p_rows, lo, full_lo, total,
                                         window, scale_log2e, HD, HDA, HDB, BLOCK_N, True, FOR_LOOP)  # fmt: skip
        acc_a, acc_b, m_i, l_i = _attend(acc_a, acc_b, m_i, l_i, q_a, q_b, k_ptr, v_ptr, p_rows, full_lo, full_hi,
                                         total, window, scale_log2e, HD, HDA, HDB, BLOCK_N, False,
                                         FOR_LOOP)  # fmt: skip
        acc_a, acc_b, m_i, l_i = _attend(acc_a, acc_b, m_i, l_i, q_a, q_b, k_ptr, v_ptr, p_rows, full_hi, hi, total,
                                         window, scale_log2e, HD, HDA, HDB, BLOCK_N, True, FOR_LOOP)  # fmt: skip

        if used > 1:
            _store_partial(part_o_ptr, part_ml_ptr, acc_a, acc_b, m_i, l_i, head, r_rows, row_ok, T, HD, HDA,
                           HDB, SPLITS)  # fmt: skip
        else:  # one split took every key: its rows are the heads
            _store_heads(out_ptr, stride_out_lane, stride_out_t, acc_a, acc_b, l_i, lane, j, r_rows, row_ok, HD,
                         HDA, HDB)  # fmt: skip


@triton.jit
def _key_blocks(start, m0, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks [lo, hi) that the query rows m0 .. m0 + BLOCK_M - 1 (positions from start) can see, with the
    block's first position p0 and its last real row's position plus one, hi_pos. `window` is at most
    start + T (no window: that), so every bound is >= 0. Positions, not rows."""
    p0 = start + m0
    hi_pos = start + tl.minimum(m0 + BLOCK_M, T)
    lo = tl.maximum(p0 - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = (hi_pos + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return p0, hi_pos, lo, hi


@triton.jit
def _used_splits(lo, hi, SPLIT_KEYS: tl.constexpr, SPLITS: tl.constexpr):
    """How many of the SPLITS programs take a share of the keys [lo, hi): one per SPLIT_KEYS of them, at least one
    (a short context keeps one pass: the partials' round trip would cost more than the split saves)."""
    return tl.minimum(tl.maximum((hi - lo) // SPLIT_KEYS, 1), SPLITS)


@triton.jit
def _store_heads(out_ptr, stride_out_lane, stride_out_t, acc_a, acc_b, l_i, lane, j, r_rows, row_ok,
                 HD: tl.constexpr, HDA: tl.constexpr, HDB: tl.constexpr):  # fmt: skip
    """The normalised rows of one query head (no key split) into out [L, T, H/L * hd]."""
    l_i = tl.where(row_ok, l_i, 1.0)  # every real row saw at least its own key: l_i >= 1
    out_rows = out_ptr + lane.to(tl.int64) * stride_out_lane + (r_rows * stride_out_t + j * HD)[:, None]
    da = tl.arange(0, HDA)
    tl.store(out_rows + da[None, :], (acc_a / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (da < HD)[None, :])  # fmt: skip
    if HDB > 0:
        db = HDA + tl.arange(0, HDB)
        tl.store(out_rows + db[None, :], (acc_b / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (db < HD)[None, :])  # fmt: skip


@triton.jit
def _store_partial(part_o_ptr, part_ml_ptr, acc_a, acc_b, m_i, l_i, head, r_rows, row_ok, T, HD: tl.constexpr,
                   HDA: tl.constexpr, HDB: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    """One split's unnormalised rows: acc into part_o [H, SPLITS, T, HD], (max, sum) into part_ml [H, SPLITS, 2, T].
    A row that saw none of this split's keys leaves (-inf, 0) and zeros."""
    part = head * SPLITS + tl.program_id(2)
    o_rows = part_o_ptr + (part.to(tl.int64) * T + r_rows)[:, None] * HD  # [BLOCK_M, 1]
    da = tl.arange(0, HDA)
    tl.store(o_rows + da[None, :], acc_a, mask=row_ok[:, None] & (da < HD)[None, :])
    if HDB > 0:
        db = HDA + tl.arange(0, HDB)
        tl.store(o_rows + db[None, :], acc_b, mask=row_ok[:, None] & (db < HD)[None, :])
    ml = part_ml_ptr + part.to(tl.int64) * 2 * T + r_rows
    tl.store(ml, m_i, mask=row_ok)
    tl.store(ml + T, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["start"])
def _merge_splits_kernel(part_o_ptr, part_ml_ptr, out_ptr, stride_out_lane, stride_out_t, T, start, start_ptr,
                         window, heads_per_lane, HD: tl.constexpr, HDP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                         START_PTR: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """out[l, r, j] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s over the splits s that took keys of head
    h = l * H/L + j's query block (m the rows' largest m_s; a split that saw none of a row's keys weighs 0). A
    block whose keys one split took has its heads written already. Grid: (H, cdiv(T, BLOCK_M))."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if START_PTR:
        start = tl.load(start_ptr).to(tl.int32)
    head = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    window = tl.minimum(window, start + T)
    _, _, lo, hi = _key_blocks(start, m0, T, window, BLOCK_M, BLOCK_N)
    used = _used_splits(lo, hi, SPLIT_KEYS, SPLITS)
    if used > 1:
        r_rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = r_rows < T
        d = tl.arange(0, HDP)
        mask = row_ok[:, None] & (d < HD)[None, :]
        ml = part_ml_ptr + (head * SPLITS).to(tl.int64) * 2 * T + r_rows  # split s: + s * 2 * T
        m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s = 0
        while s < used:
            m_all = tl.maximum(m_all, tl.load(ml + s * 2 * T, mask=row_ok, other=0.0))
            s += 1
        den = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HDP], dtype=tl.float32)
        s = 0
        while s < used:  # m_all is finite: every real row saw its own key in some split
            weight = tl.exp2(tl.load(ml + s * 2 * T, mask=row_ok, other=0.0) - m_all)
            den += weight * tl.load(ml + s * 2 * T + T, mask=row_ok, other=1.0)
            o_rows = part_o_ptr + ((head * SPLITS + s).to(tl.int64) * T + r_rows)[:, None] * HD
            acc += weight[:, None] * tl.load(o_rows + d[None, :], mask=mask, other=0.0)
            s += 1
        lane = head // heads_per_lane
        j = head % heads_per_lane
        out_rows = out_ptr + lane.to(tl.int64) * stride_out_lane + (r_rows * stride_out_t + j * HD)[:, None]
        tl.store(out_rows + d[None, :], (acc / den[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def key_splits(programs: int, multiprocessors: int, most: int = 16) -> int:
    """How many ways to split the keys of `programs` (query head, row block) programs: none where they fill the
    GPU, else a power of two up to `most` that makes ~2 programs a multiprocessor. Empty splits (fewer keys than
    the split count expects) end at once; the merge is one more small launch."""
    if programs >= multiprocessors:
        return 1
    return min(most, triton.next_power_of_2(triton.cdiv(2 * multiprocessors, programs)))


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """The head dim as tl.dot operands: two power-of-two parts when the remainder is one of at least 16
    (96 -> 64 + 32, 48 -> 32 + 16, 80 -> 64 + 16: no padding), else one part padded to a power of two
    (24 -> 32, 8 -> 16, 112 -> 128; 64, 128 as they are)."""
    padded = max(16, triton.next_power_of_2(head_dim))
    rest = head_dim - padded // 2
    if head_dim < padded and rest >= 16 and rest & (rest - 1) == 0:
        return padded // 2, rest
    return padded, 0


def default_blocks(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Up to 128 dims: 64 query rows and 64 keys on 4 warps (one
    warpgroup of wgmma), the next two key/value blocks in flight. 128 rows on 8 warps need ~243 registers (one
    program a multiprocessor) and ran slower, as did 128 x 32 and 64 x 64 on 8 warps (docs/fast-path.md). Above
    128 dims the accumulator alone would fill the registers: 64 rows and 32 keys on 8 warps (no spills at 256).
    Under the interpreter: the smallest blocks tl.dot takes."""
    if interpreted():
        return 16, 16, 4, 1
    if head_dim > 128:
        return 64, 32, 8, 2
    return 64, 64, 4, 3


def prefill_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    window: int | None = None,
    interleaved: bool = True,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    start: int | torch.Tensor = 0,
    splits: int | None = None,
    split_keys: int = SPLIT_KEYS,
    use_pdl: bool = False,
) -> torch.Tensor:
    """Attention of positions start .. start + T - 1 of a prompt over themselves and the start positions before
    them (already in the cache: a reused prefix); writes their keys and values into the cache first
    (prefill_kv_write) and returns the heads [L, T, H/L * hd] (in `out` when given).

    qkv: [L, T, (H/L + 2 KV/L) * hd], per lane and position: q heads, then k heads, then v heads (before RoPE).
    k_cache, v_cache: [KV, max_len, hd] of this layer, qkv's dtype. cos, sin: [>= start + T, hd/2] fp32.
    window: keys p - window + 1 .. p (None: causal). q_norm, k_norm: [hd] (Qwen3) or None.
    start: an int, or a device int tensor [1] read at launch (a CUDA graph's: start + T must fit the cache).
    splits: how many programs share a query block's keys (a power of two; None: key_splits, where the query
    blocks alone leave multiprocessors idle); a block takes one per split_keys keys it sees, at least one.
    """
    lanes, T, heads_per_lane, _ = check_prefill_layout(qkv, k_cache, v_cache, cos, sin, num_heads, q_norm,
                                                       k_norm, start)  # fmt: skip
    num_kv, max_len, hd = k_cache.shape
    if window is not None and window < 1:
        raise ValueError(f"window: expected None or >= 1, got {window}")
    if out is None:
        out = torch.empty(lanes, T, heads_per_lane * hd, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (lanes, T, heads_per_lane * hd) or out.stride(2) != 1:
        raise ValueError(f"out: expected [{lanes}, {T}, {heads_per_lane * hd}] with a contiguous last dim, "
                         f"got {tuple(out.shape)}")  # fmt: skip
    hda, hdb = head_dim_parts(hd)
    bm, bn, warps, stages = default_blocks(hd)
    if block_m is None:  # a short suffix after a long prefix: more, smaller query blocks keep the SMs busy
        while bm > 16 and num_heads * triton.cdiv(T, bm) < sm_count(qkv.device):
            bm //= 2
    bm, bn = block_m or bm, block_n or bn
    if bm < 16 or bn < 16 or bm & (bm - 1) or bn & (bn - 1):
        raise ValueError(f"block_m: block_m and block_n must be powers of two >= 16, got {bm}, {bn}")
    query_blocks = triton.cdiv(T, bm)
    if splits is None:  # an int start bounds the keys now; a device scalar's (a graph's) only at each replay
        few_keys = not isinstance(start, torch.Tensor) and start + T < 2 * split_keys
        splits = 1 if few_keys else key_splits(num_heads * query_blocks, sm_count(qkv.device))
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits: expected a power of two >= 1, got {splits}")
    if split_keys < bn or split_keys % bn:
        raise ValueError(f"split_keys: expected a multiple of the key block ({bn}), got {split_keys}")
    if splits > 1:  # fp32 partials [H, splits, T, hd] and their (max, sum) [H, splits, 2, T]
        part_o = torch.empty(num_heads, splits, T, hd, dtype=torch.float32, device=qkv.device)
        part_ml = torch.empty(num_heads, splits, 2, T, dtype=torch.float32, device=qkv.device)
    else:
        part_o = part_ml = out  # unused

    launch_prefill_kv_write(qkv, k_cache, v_cache, cos, sin, num_heads=num_heads, interleaved=interleaved,
                            k_norm=k_norm, eps=eps, start=start, use_pdl=use_pdl)  # fmt: skip
    _prefill_attention_kernel[(num_heads, query_blocks, splits)](
        qkv,
        qkv.stride(0),
        qkv.stride(1),
        k_cache,
        v_cache,
        cos,
        sin,
        q_norm if q_norm is not None else cos,
        out,
        out.stride(0),
        out.stride(1),
        part_o,
        part_ml,
        T,
        *start_args(start, cos),
        heads_per_lane,
        num_heads // num_kv,
        max_len,
        window or max_len,  # the kernel caps it at start + T
        hd**-0.5 * LOG2E,
        eps,
        HD=hd,
        HDP=max(16, triton.next_power_of_2(hd)),
        HDA=hda,
        HDB=hdb,
        BLOCK_M=bm,
        BLOCK_N=bn,
        SPLITS=splits,
        SPLIT_KEYS=split_keys,
        INTERLEAVED=interleaved,
        QK_NORM=q_norm is not None,
        FOR_LOOP=not interpreted(),
        START_PTR=isinstance(start, torch.Tensor),
        USE_PDL=use_pdl,
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
        **pdl_kwargs(use_pdl),
    )
    if splits > 1:
        _merge_splits_kernel[(num_heads, query_blocks)](
            part_o, part_ml, out, out.stride(0), out.stride(1), T, *start_args(start, cos), window or max_len,
            heads_per_lane, HD=hd, HDP=max(16, triton.next_power_of_2(hd)), BLOCK_M=bm, BLOCK_N=bn, SPLITS=splits,
            SPLIT_KEYS=split_keys, START_PTR=isinstance(start, torch.Tensor), USE_PDL=use_pdl, **pdl_kwargs(use_pdl),
        )  # fmt: skip
    return out
