"""A decode layer's weights as the fast runner's kernels read them, and how its lane partials reach the
residual."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from inference.config import ModelConfig
from kernels.decode_attention import AttentionScratch
from kernels.packed_mma_gemv import MmaPackedWeight


def reduction(cfg: ModelConfig, layer: int) -> tuple[str, int | None]:
    """model.Transformer.reduce as a kernel mode: (mode, layer whose raw partials it reads)."""
    lanes, d = cfg.num_lanes, cfg.broadcast_delay
    if lanes == 1:
        return "sum", None
    if layer < d:
        return ("sum" if cfg.use_early_comm else "scaled"), None
    if not cfg.use_comm:
        return "scaled", None
    if d == 0:
        return "sum", None
    return "delayed", layer - d


def split_from(cfg: ModelConfig) -> int:
    """The first layer after which no reduction is an immediate sum (every lane's partial of the same layer):
    from there on lane groups can run apart (num_layers: never)."""
    return max((i + 1 for i in range(cfg.num_layers) if reduction(cfg, i)[0] == "sum"), default=0)


@dataclass
class LayerWeights:
    attention_norm: torch.Tensor  # [L, D]
    wqkv: torch.Tensor  # [L, (H/L + 2 KV/L) * hd, D]: each lane's q rows, then k, then v
    bqkv: torch.Tensor | None  # [L, (H/L + 2 KV/L) * hd]
    q_norm: torch.Tensor | None  # [hd]
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # [L, D, H/L * hd]
    ffn_norm: torch.Tensor  # [L, D]
    w1: torch.Tensor  # [L, F/L, D]
    w3: torch.Tensor
    w2: torch.Tensor  # [L, D, F/L]
    window: int | None
    mode: str  # how the lane partials reach the residual (kernels/lane_reduce_gemv.py)
    history_in: int | None  # the layer whose partials DELAYED mode adds
    # One-lane models: the o-proj, gate/up (w1's rows, then w3's) and down-proj in 12 bits a weight for the
    # tensor cores (settings.packed), and the packed gate/up's norm weight [D] in bf16 (its kernel reads bf16)
    wo_packed: MmaPackedWeight | None = None
    w13_packed: MmaPackedWeight | None = None
    w2_packed: MmaPackedWeight | None = None
    ffn_norm_bf16: torch.Tensor | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, i: int, block) -> LayerWeights:
        """Layer i of the reference model (block: its model.Block) with q|k|v as one matrix."""
        mode, history_in = reduction(cfg, i)
        bqkv = None if block.bq is None else torch.cat([block.bq, block.bk, block.bv], dim=1).contiguous()
        wqkv = torch.cat([block.wq, block.wk, block.wv], dim=1).contiguous()
        return cls(attention_norm=block.attention_norm, wqkv=wqkv, bqkv=bqkv, q_norm=block.q_norm, k_norm=block.k_norm, wo=block.wo, ffn_norm=block.ffn_norm,
                   w1=block.w1, w3=block.w3, w2=block.w2, window=block.window, mode=mode,
                   history_in=history_in)  # fmt: skip

    def lanes(self, start: int, stop: int) -> LayerWeights:
        """The weights of lanes [start, stop) (views; lanes are the outer dimension)."""
        per_lane = ("attention_norm", "wqkv", "bqkv", "wo", "ffn_norm", "w1", "w3", "w2")
        return replace(
            self, **{f: getattr(self, f)[start:stop] for f in per_lane if getattr(self, f) is not None}
        )


@dataclass
class LaneGroup:
    """Lanes [start, stop) of the model with their views of the step's buffers (all lanes: one group)."""

    start: int
    stop: int
    layers: list[LayerWeights]
    x: torch.Tensor  # [lanes, D] fp32
    qkv: torch.Tensor  # [lanes, (H/L + 2 KV/L) * hd]
    attn: torch.Tensor  # [lanes, H/L * hd]
    h: torch.Tensor  # [lanes, F/L]
    kv_heads: slice  # of the cache's KV heads
    num_heads: int
    scratch: AttentionScratch  # its own: groups run at the same time
