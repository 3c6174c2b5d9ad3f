"""The ceiling decode is measured against: the device's read bandwidth, measured in the same run, and the bytes
one decode step (and each of its kernels) must read. Ceiling tok/s = bandwidth / bytes per token."""

from __future__ import annotations

import torch

from inference.bench.timing import median_ms
from inference.config import ModelConfig
from inference.model import Transformer


def measure_bandwidth(device: torch.device, gib: int = 4) -> dict:
    """Read bandwidth of a large reduction (bytes read) and of a copy (bytes read + written), GB/s."""
    src = torch.empty(gib * 2**30 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    result = {
        "read_gbs": src.numel() * 4 / median_ms(src.sum) / 1e6,
        "copy_gbs": 2 * src.numel() * 4 / median_ms(lambda: dst.copy_(src)) / 1e6,
    }
    src = dst = None
    torch.cuda.empty_cache()
    return result


def kernel_bytes(cfg: ModelConfig, itemsize: int, context: int, head_screen: bool = False,
                 packed: dict[tuple[int, str], int] | None = None) -> list[tuple[str, int]]:  # fmt: skip
    """(kind, bytes it must read) for every kernel of one decode step, in launch order; `context` cached keys.
    With head_screen the head is kernels/lm_head_screen.py's two launches: the int8 copy with a scale and two norms
    a row, then the rows' upper bounds (the candidates' bf16 rows, a few, are not counted). packed: the bytes of
    the matrices a runner reads in 12 bits, by (layer, kind) (FastRunner.packed_bytes)."""
    D, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_lanes
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    out = []
    for i in range(cfg.num_layers):
        keys = min(context + 1, cfg.window(i) or context + 1)
        out += [
            ("qkv", (qkv_rows * D + L * D + (qkv_rows if cfg.qkv_bias else 0)) * itemsize),
            ("attention", 2 * cfg.num_kv_heads * hd * keys * itemsize),
            ("o-proj", D * cfg.num_heads * hd * itemsize),
            ("gate/up", (2 * cfg.intermediate_size * D + L * D) * itemsize),
            ("down", D * cfg.intermediate_size * itemsize),
        ]
        for slot, kind in ((-5, "qkv"), (-3, "o-proj"), (-2, "gate/up"), (-1, "down")):
            if packed and (i, kind) in packed:
                out[slot] = (kind, packed[i, kind])
    if L > 1:
        out.append(("final norm", L * D * itemsize))
    if head_screen:
        out += [("head screen", cfg.vocab_size * (D + 12)), ("head rescore", cfg.vocab_size * 4)]
    else:
        out.append(("head", cfg.vocab_size * D * itemsize))
    return out


def step_bytes(model: Transformer, context: int) -> int:
    """Bytes one decode step reads: every weight once (the embedding only one row unless it is the head), plus
    the keys and values in each layer's window."""
    cfg, item = model.cfg, model.tok_embeddings.element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "tok_embeddings") * item
    embedding = (cfg.vocab_size if model.lm_head is None else 1) * cfg.hidden_size * item
    kv = sum(b for kind, b in kernel_bytes(cfg, item, context) if kind == "attention")
    return weights + embedding + kv
