"""The fast runner's prefill: the reference model's math over a whole prompt, writing the KV cache that the
decode kernels read.

A layer is five launches besides its cuBLAS matrix products:
    q|k|v matmul (cuBLAS)       h [L, T, D] -> qkv [L, T, (H/L + 2 KV/L) * hd] (+ Qwen2's bias)
    prefill_attention           two kernels: the rotated (q/k-normed) keys and the values into the cache
                                (kernels/prefill_kv_write.py), then flash attention reading q from qkv with RoPE
                                on the fly, the keys from the cache, skipping the blocks a window or causality
                                masks, and writing the heads as [L, T, H/L * hd], the o-proj's input
    o-proj matmul, then prefill_residual_norm: the lane reduction into the residual and the ffn norm
    gate/up/down (cuBLAS + SiLU), then prefill_residual_norm with the next layer's attention norm
Each block boundary is one kernel (kernels/prefill_residual_norm.py): eager, those [L, T, D] casts, lane sums
and adds were most of a long Laneformer prefill's GPU time. There is no SDPA fallback: the attention kernel
takes every head dim the runner's models have (even, up to 256; it checks and names what it refuses).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from inference.model import rms_norm
from kernels.prefill_attention import prefill_attention
from kernels.prefill_residual_norm import prefill_residual_norm

if TYPE_CHECKING:
    from inference.fast.runner import FastRunner, LayerWeights


@torch.no_grad()
def forward_prompt(runner: FastRunner, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """model.forward over a prompt ids [T] into runner.cache; the logits [V] at position last [1]."""
    cfg, model = runner.cfg, runner.model
    lanes, dim, eps = cfg.num_lanes, cfg.hidden_size, cfg.norm_eps
    T = ids.shape[0]
    attn_blocks, norm_blocks = runner.prefill_blocks
    embedded = F.embedding(ids, runner.embed).view(1, T, dim)
    x = embedded.expand(lanes, T, dim)  # [L, T, D]: every lane starts from the same row
    # The lanes' rows are equal, so the first norm's statistics are taken once ([1, T, D]) and only the
    # per-lane scale broadcasts to [L, T, D].
    h = rms_norm(embedded, runner.layers[0].attention_norm[:, None], eps)
    # Raw lane partials [L, T, D] by layer; each is dropped once nothing reads it again (a delayed layer reads
    # the partials of layer i - d), so a long prompt holds ~d + 1 of them, not one per layer.
    attn_partials: list[torch.Tensor | None] = []
    mlp_partials: list[torch.Tensor | None] = []
    read_later = {w.history_in for w in runner.layers if w.mode == "delayed"}
    for i, (block, w) in enumerate(zip(model.layers, runner.layers, strict=True)):
        qkv = h @ w.wqkv.mT  # [L, T, (H/L + 2 KV/L) * hd]
        if w.bqkv is not None:
            qkv = qkv + w.bqkv[:, None]
        # the cache rows 0 .. T-1 of layer i written, and the heads [L, T, H/L * hd] for the o-proj
        heads = prefill_attention(qkv, runner.cache.k[i, 0], runner.cache.v[i, 0], model.rope_cos,
                                  model.rope_sin, num_heads=cfg.num_heads, window=w.window, q_norm=w.q_norm,
                                  k_norm=w.k_norm, eps=eps, **attn_blocks)  # fmt: skip
        next_norm = runner.layers[i + 1].attention_norm if i + 1 < len(runner.layers) else None
        attn_partials.append(heads @ w.wo.mT)  # [L, T, D] raw lane partials
        x, h = _residual_norm(runner, i, w, x, attn_partials, w.ffn_norm, norm_blocks)
        mlp_partials.append(block.mlp(h))
        x, h = _residual_norm(runner, i, w, x, mlp_partials, next_norm, norm_blocks)
        for partials in (attn_partials, mlp_partials):
            if i not in read_later:
                partials[i] = None
            if w.mode == "delayed":
                partials[w.history_in] = None
    return model._head(x.index_select(1, last)).view(-1).float()


def _residual_norm(runner: FastRunner, i: int, w: LayerWeights, x: torch.Tensor,
                   partials: list[torch.Tensor | None],
                   norm_weight: torch.Tensor | None,
                   blocks: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x + model._reduce(i, partials[i], partials), and rms_norm of it with norm_weight [L, D] (or None)."""
    past = partials[w.history_in] if w.mode == "delayed" else None
    return prefill_residual_norm(x, partials[i], mode=w.mode, past=past, norm_weight=norm_weight,
                                 eps=runner.cfg.norm_eps, **blocks)  # fmt: skip


def block_overrides(name: str, keys: tuple[str, ...]) -> dict[str, int]:
    """Block sizes from the environment for sweeps on the device (read once, by the runner), e.g. KOG_PREFILL_ATTN=128,64,8,3 (block_m,
    block_n, num_warps, num_stages) or KOG_PREFILL_NORM=256,4,4 (block_d, num_warps, stages); unset or 0
    keeps the kernel's own choice."""
    values = [int(v) for v in os.environ.get(name, "").split(",") if v.strip()]
    if len(values) > len(keys):
        raise ValueError(f"{name}: at most {len(keys)} values ({', '.join(keys)}), got {len(values)}")
    return {key: value for key, value in zip(keys, values, strict=False) if value}
