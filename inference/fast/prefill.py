"""The fast runner's prefill: the reference model's math over a whole prompt, writing the KV cache that the
decode kernels read.

One q|k|v matmul a layer (cuBLAS) and attention on the fused SDPA kernels: a windowed layer longer than its
window gets an explicit mask, and then its KV heads are repeated, because SDPA runs GQA with a mask in its
slow math kernel. Each block boundary (the lane reduction into the residual and the next norm) is one kernel,
kernels/prefill_residual_norm.py: eager, those [L, T, D] casts, lane sums and adds were most of a long
Laneformer prefill's GPU time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from inference.model import apply_rope, attention_mask, rms_norm, rope_pairs
from kernels.prefill_residual_norm import prefill_residual_norm

if TYPE_CHECKING:
    from inference.fast.runner import FastRunner, LayerWeights


@torch.no_grad()
def forward_prompt(runner: FastRunner, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """model.forward over a prompt ids [T] into runner.cache; the logits [V] at position last [1]."""
    cfg, model = runner.cfg, runner.model
    lanes, dim, hd, eps = cfg.num_lanes, cfg.hidden_size, cfg.head_dim, cfg.norm_eps
    q_rows, kv_rows = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd
    group = cfg.num_heads // cfg.num_kv_heads
    T = ids.shape[0]
    cos, sin = rope_pairs(model.rope_cos[:T], model.rope_sin[:T])  # [T, hd]
    x = F.embedding(ids, runner.embed).view(1, T, dim).expand(lanes, T, dim)  # [L, T, D]
    h = rms_norm(x, runner.layers[0].attention_norm[:, None], eps)
    attn_partials: list[torch.Tensor] = []
    mlp_partials: list[torch.Tensor] = []
    for i, (block, w) in enumerate(zip(model.layers, runner.layers, strict=True)):
        qkv = h @ w.wqkv.mT  # [L, T, (H/L + 2 KV/L) * hd]
        if w.bqkv is not None:
            qkv = qkv + w.bqkv[:, None]
        q, k, v = (block._heads(t, 1, T) for t in qkv.split([q_rows, kv_rows, kv_rows], dim=-1))
        if w.q_norm is not None:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [1, H, T, hd], [1, KV, T, hd]
        runner.cache.k[i, :, :, :T] = k
        runner.cache.v[i, :, :, :T] = v
        if w.window is None or w.window >= T:  # a window at least as long as the prompt is plain causal
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
        else:
            mask = attention_mask(0, T, 0, T, w.window, ids.device)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.unflatten(1, (lanes, -1)).permute(1, 0, 3, 2, 4).reshape(lanes, T, -1)
        next_norm = runner.layers[i + 1].attention_norm if i + 1 < len(runner.layers) else None
        attn_partials.append(out @ w.wo.mT)  # [L, T, D] raw lane partials
        x, h = _residual_norm(runner, i, w, x, attn_partials, w.ffn_norm)
        mlp_partials.append(block.mlp(h))
        x, h = _residual_norm(runner, i, w, x, mlp_partials, next_norm)
    return model._head(x.index_select(1, last)).view(-1).float()


def _residual_norm(runner: FastRunner, i: int, w: LayerWeights, x: torch.Tensor, partials: list[torch.Tensor],
                   norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x + model._reduce(i, partials[i], partials), and rms_norm of it with norm_weight [L, D] (or None)."""
    past = partials[w.history_in] if w.mode == "delayed" else None
    return prefill_residual_norm(x, partials[i], mode=w.mode, past=past, norm_weight=norm_weight,
                                 eps=runner.cfg.norm_eps)  # fmt: skip
