"""The o-proj and its residual add as decode attention's epilogue (one-lane models: Llama, Qwen2/3).

    x[n] += sum_c Wo[n, c] * attn[c]       c over the H * hd attention outputs, n over the D rows

Split over the attention's programs: KV head g's programs hold the merged outputs of g's G query heads
(G * hd columns of Wo), and split s of them owns rows [s * R, (s + 1) * R). So each program multiplies an
[R, G * hd] tile of Wo (Llama-3.2-1B and Qwen3-1.7B: 128 x 256, 64 KB) by its head group's outputs and adds the
[R] result into the fp32 residual with atomics: the KV heads' shares of a row meet there, in no fixed order.

Why: as separate kernels, the o-proj starts streaming its weights only beside the attention's last programs,
and the attention (a chain of dependent reads) leaves the memory idle meanwhile. Here the tile is requested
before the attention waits for q|k|v, so the o-proj's bytes stream during the attention and the boundary
between the two kernels is gone.

The helpers below run inside kernels/decode_attention.py's kernel.
"""

import triton
import triton.language as tl


@triton.jit
def o_proj_tiles(wo_ptr, stride_wo, kv, first_row, dim, G: tl.constexpr, HD: tl.constexpr, GP: tl.constexpr,
                 HDP: tl.constexpr, CHUNK: tl.constexpr, FIRST: tl.constexpr, COUNT: tl.constexpr):  # fmt: skip
    """Loads of the row chunks FIRST .. FIRST + COUNT - 1 of KV head kv's Wo columns, from row first_row on, as
    a tuple of [CHUNK, GP, HDP] tiles (padded heads and dims, and rows past dim, are 0). Weights are read once
    per token: evicted first."""
    g = tl.arange(0, GP)
    d = tl.arange(0, HDP)
    cols = (kv * G + g)[:, None] * HD + d[None, :]  # [GP, HDP]
    col_ok = (g < G)[:, None] & (d < HD)[None, :]
    tiles = ()
    for i in tl.static_range(FIRST, FIRST + COUNT):
        rows = first_row + i * CHUNK + tl.arange(0, CHUNK)
        offs = rows.to(tl.int64)[:, None, None] * stride_wo + cols[None, :, :]
        mask = (rows < dim)[:, None, None] & col_ok[None, :, :]
        tiles = tiles + (tl.load(wo_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first"),)
    return tiles


@triton.jit
def merge_splits(part_o_ptr, part_ml_ptr, parts, GP: tl.constexpr, HDP: tl.constexpr):
    """[GP, HDP] fp32: the softmax-weighted merge of one KV head's split partials (parts: their [SPLITS]
    indices; unnormalised outputs, maxima and sums as decode attention stores them)."""
    g = tl.arange(0, GP)
    d = tl.arange(0, HDP)
    ml_offs = (parts[:, None] * 2) * GP + g[None, :]  # [SPLITS, GP]
    ms = tl.load(part_ml_ptr + ml_offs, cache_modifier=".cg")
    ls = tl.load(part_ml_ptr + ml_offs + GP, cache_modifier=".cg")
    m_all = tl.max(ms, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(ms - m_all[None, :])  # [SPLITS, GP]; empty splits weigh 0
    o_offs = (parts[:, None, None] * GP + g[None, :, None]) * HDP + d[None, None, :]
    os = tl.load(part_o_ptr + o_offs, cache_modifier=".cg")
    return tl.sum(os * w[:, :, None], axis=0) / tl.sum(w * ls, axis=0)[:, None]


@triton.jit
def o_proj_add(tiles, o, x_ptr, first_row, dim, CHUNK: tl.constexpr):
    """x[first_row + r] += sum over the tile's columns of tile[r] * o, for every row chunk of `tiles` (from
    o_proj_tiles); o: [GP, HDP] fp32, the head group's merged outputs. The add is atomic: the other KV heads
    add their shares of the same rows."""
    for i in tl.static_range(len(tiles)):
        rows = first_row + i * CHUNK + tl.arange(0, CHUNK)
        share = tl.sum(tl.sum(tiles[i].to(tl.float32) * o[None, :, :], axis=2), axis=1)  # [CHUNK]
        tl.atomic_add(x_ptr + rows, share, mask=rows < dim, sem="relaxed")
