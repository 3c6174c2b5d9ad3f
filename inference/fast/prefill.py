"""The fast runner's prefill: the reference model's math over a whole prompt, writing the KV cache that the
decode kernels read.

A layer is five Triton launches besides its matrix products (and Qwen2's eager bias add):
    q|k|v matmul                h [L, T, D] -> qkv [L, T, (H/L + 2 KV/L) * hd] (+ Qwen2's bias)
    prefill_attention           two kernels: the rotated (q/k-normed) keys and the values into the cache
                                (kernels/prefill_kv_write.py), then flash attention reading q from qkv with RoPE
                                on the fly, the keys from the cache, skipping the blocks a window or causality
                                masks, and writing the heads as [L, T, H/L * hd], the o-proj's input
    o-proj matmul, then prefill_residual_norm (the lane reduction into the residual and the ffn norm), gate and
    up matmuls ([L, T, F/L] each: w1 and w3 stay apart) and silu_mul (kernels/silu_mul.py, written over gate),
    the down matmul, prefill_residual_norm with the next layer's attention norm
The products are cuBLAS's, but up to 32 rows (a verify step, a short suffix) kernels/skinny_matmul.py's: gate/up
and gating in one launch, the others where its launch streams the weight faster. With `pdl` (a Hopper GPU) the
Triton launches after the first wait on the one before by programmatic dependent launch (not the last layer's). The last layer writes every position's
keys and values into the cache, then goes on for the one position whose logits are asked for (its attention
through the decode kernel, its o-proj, MLP and head eager on that row): nothing reads the other rows. Each block
boundary is one kernel (kernels/prefill_residual_norm.py): eager, those [L, T, D] casts, lane sums and adds were
most of a long Laneformer prefill's GPU time. There is no SDPA fallback: the attention kernel takes every head
dim the runner's models have (even, up to 256; it checks and names what it refuses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inference.model import KVCache, Transformer, rms_norm
from kernels.decode_attention import AttentionScratch, decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.prefill_embed_norm import prefill_embed_norm
from kernels.prefill_kv_write import launch_prefill_kv_write
from kernels.prefill_residual_norm import prefill_residual_norm
from kernels.silu_mul import silu_mul
from kernels.skinny_matmul import MAX_ROWS as SKINNY_ROWS
from kernels.skinny_matmul import few_rows_matmul, skinny_glu

if TYPE_CHECKING:
    from inference.fast.layers import LayerWeights


@torch.no_grad()
def forward_prompt(model: Transformer, layers: list[LayerWeights], cache: KVCache, scratch: AttentionScratch,
                   ids: torch.Tensor, last: torch.Tensor | None, start: int | torch.Tensor = 0,
                   pdl: bool = False) -> torch.Tensor:  # fmt: skip
    """model.forward over a prompt ids [T] at positions start .. start + T - 1 into cache (whose rows before start
    hold a reused prefix's keys and values; start: an int, or a device int64 [1] a graph reads at each replay);
    the logits [V] at row last [1] of ids. layers: the model's as the
    runner holds them (q|k|v as one matrix); scratch: the decode attention's, for the last position. Everything
    else a layer carries across rows (the delayed reduction's partials) is per position.
    last None: every row's logits [T, V] (a speculative verify step's; the last layer runs as the others)."""
    cfg = model.cfg
    lanes, dim, eps = cfg.num_lanes, cfg.hidden_size, cfg.norm_eps
    T = ids.shape[0]
    # The embedding rows and the first norm in one launch (kernels/prefill_embed_norm.py): every lane starts from
    # the same row, so x is a broadcast view [L, T, D] and h [L, T, D] the norm with each lane's scale.
    embedded, h = prefill_embed_norm(ids, model.tok_embeddings, layers[0].attention_norm, eps)
    x = embedded.view(1, T, dim).expand(lanes, T, dim)
    # Raw lane partials [L, T, D] by layer; each is dropped once nothing reads it again (a delayed layer reads
    # the partials of layer i - d), so a long prompt holds ~d + 1 of them, not one per layer.
    attn_partials: list[torch.Tensor | None] = []
    mlp_partials: list[torch.Tensor | None] = []
    read_later = {w.history_in for w in layers if w.mode == "delayed"}
    for i, w in enumerate(layers):
        qkv = few_rows_matmul(h, w.wqkv, pdl)  # [L, T, (H/L + 2 KV/L) * hd]
        if w.bqkv is not None:
            qkv = qkv + w.bqkv[:, None]
        if i == len(layers) - 1 and last is not None:
            return _last_layer(model, cache, scratch, i, w, x, qkv, last, attn_partials, mlp_partials, start)
        # the cache rows start .. start + T - 1 of layer i written, and the heads [L, T, H/L * hd] for the o-proj
        heads = prefill_attention(qkv, cache.k[i, 0], cache.v[i, 0], model.rope_cos, model.rope_sin,
                                  num_heads=cfg.num_heads, window=w.window, q_norm=w.q_norm, k_norm=w.k_norm,
                                  eps=eps, start=start, use_pdl=pdl)  # fmt: skip
        next_norm = layers[i + 1].attention_norm if i + 1 < len(layers) else None
        attn_partials.append(few_rows_matmul(heads, w.wo, pdl))  # [L, T, D] raw lane partials
        x, h = _residual_norm(i, w, x, attn_partials, w.ffn_norm, eps, pdl)
        # block.mlp's math: silu(h w1^T) * (h w3^T), rounded as eager rounds it, then w2 (lane partials)
        if T <= SKINNY_ROWS:
            glu = skinny_glu(h, w.w1, w.w3, use_pdl=pdl)  # [L, T, F/L]
        else:
            gate = torch.bmm(h, w.w1.mT)  # [L, T, F/L]
            glu = silu_mul(gate, torch.bmm(h, w.w3.mT), out=gate)
        mlp_partials.append(few_rows_matmul(glu, w.w2, pdl))
        x, h = _residual_norm(i, w, x, mlp_partials, next_norm, eps, pdl)
        for partials in (attn_partials, mlp_partials):
            if i not in read_later:
                partials[i] = None
            if w.mode == "delayed":
                partials[w.history_in] = None
    return model.head(x).float()  # every row: [T, V]


def _last_layer(model: Transformer, cache: KVCache, scratch: AttentionScratch, i: int, w: LayerWeights,
                x: torch.Tensor, qkv: torch.Tensor, last: torch.Tensor, attn_partials: list[torch.Tensor | None],
                mlp_partials: list[torch.Tensor | None], start: int | torch.Tensor = 0) -> torch.Tensor:  # fmt: skip
    """The last layer, where only the position `last` goes on: every position's keys and values still go into
    the cache, but attention, the o-proj, the MLP and the head run for that one row, as a decode step would
    (kernels/decode_attention.py reads q from qkv's row `last` and the keys before it from the cache). The
    rest of the reference's last layer computes rows that nothing reads: at 4,096 tokens of a 15-layer model
    that is ~6% of the prefill's matrix products, plus its attention and two block boundaries.

    x: [L, T, D] the residual after layer i - 1; qkv: [L, T, rows] this layer's projections. Returns the
    logits [V] fp32 at `last`, as model.forward would (its eager math on the selected row)."""
    cfg = model.cfg
    lanes, eps = cfg.num_lanes, cfg.norm_eps
    k_cache, v_cache = cache.k[i, 0], cache.v[i, 0]
    launch_prefill_kv_write(qkv, k_cache, v_cache, model.rope_cos, model.rope_sin, num_heads=cfg.num_heads,
                            interleaved=True, k_norm=w.k_norm, eps=eps, start=start)  # fmt: skip
    heads = torch.empty(lanes, cfg.heads_per_lane * cfg.head_dim, dtype=qkv.dtype, device=qkv.device)
    position = (last + start).to(torch.int32)  # row `last` of the prompt's part sits at this position
    decode_attention(qkv.index_select(1, last).view(lanes, -1), k_cache, v_cache, position,
                     model.rope_cos, model.rope_sin, heads, scratch, num_heads=cfg.num_heads, window=w.window,
                     q_norm=w.q_norm, k_norm=w.k_norm, eps=eps)  # fmt: skip

    def row(partials: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        # model.reduce appends this layer's partial and reads the one d layers back: the same list, one row
        return [p.index_select(1, last) if p is not None else None for p in partials]

    x = x.index_select(1, last)  # [L, 1, D]
    x = x + model.reduce(i, heads.view(lanes, 1, -1) @ w.wo.mT, row(attn_partials))
    block = model.layers[i]
    x = x + model.reduce(i, block.mlp(rms_norm(x, w.ffn_norm[:, None], eps)), row(mlp_partials))
    return model.head(x).view(-1).float()


def _residual_norm(i: int, w: LayerWeights, x: torch.Tensor, partials: list[torch.Tensor | None],
                   norm_weight: torch.Tensor | None, eps: float,
                   pdl: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x + model.reduce(i, partials[i], partials), and rms_norm of it with norm_weight [L, D] (or None)."""
    past = partials[w.history_in] if w.mode == "delayed" else None
    return prefill_residual_norm(x, partials[i], mode=w.mode, past=past, norm_weight=norm_weight, eps=eps,
                                 use_pdl=pdl)  # fmt: skip
