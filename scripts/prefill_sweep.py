"""The long prefill's own kernels alone, at a model's real shapes (GPU only): prefill attention per block
configuration and the MLP's SiLU-multiply, fused against eager.

    python scripts/prefill_sweep.py [--model laneformer-2b] [--tokens 4094] [--json out.json]

Attention is timed for one windowed and one causal layer (each a cache write + the flash attention launch) and
reported as the model's total over its layers; every configuration's output is compared with the default's.
Times are CUDA-event medians after a warm-up.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from inference.bench.model_setup import cuda_missing  # noqa: E402
from inference.bench.timing import median_ms  # noqa: E402
from inference.config import ModelConfig  # noqa: E402
from inference.model import rope_tables  # noqa: E402
from inference.presets import preset_config  # noqa: E402
from kernels.prefill_attention import default_blocks, prefill_attention  # noqa: E402
from kernels.prefill_kv_write import launch_prefill_kv_write  # noqa: E402

# (block_m, block_n, num_warps, num_stages)
CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3), (64, 32, 4, 3),
           (64, 32, 4, 4), (32, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]  # fmt: skip


def attention_sweep(cfg: ModelConfig, tokens: int) -> list[dict]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    lanes, hd = cfg.num_lanes, cfg.head_dim
    rows = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * hd
    qkv = torch.randn(lanes, tokens, rows, device=device, dtype=dtype)
    k_cache = torch.zeros(cfg.num_kv_heads, cfg.max_position_embeddings, hd, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    cos, sin = rope_tables(cfg, device)
    window = cfg.sliding_window if cfg.sliding_window and cfg.sliding_window < tokens else None
    windowed = sum(1 for i in range(cfg.num_layers) if cfg.window(i) is not None) if window else 0
    causal = cfg.num_layers - windowed
    results, want = [], {}
    for blocks in CONFIGS:
        kw = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), blocks, strict=True))
        row = {"blocks": blocks, "default": blocks == default_blocks(hd)}
        try:
            for name, w in (("windowed", window), ("causal", None)):
                if name == "windowed" and not windowed:
                    continue

                def run(w=w, kw=kw):
                    return prefill_attention(qkv, k_cache, v_cache, cos, sin, num_heads=cfg.num_heads, window=w,
                                             q_norm=None, k_norm=None, eps=cfg.norm_eps, **kw)  # fmt: skip

                row[f"{name}_ms"] = median_ms(run)
                out = run().float()
                want.setdefault(name, out)
                row[f"{name}_max_diff"] = (out - want[name]).abs().max().item()
            row["model_ms"] = windowed * row.get("windowed_ms", 0.0) + causal * row["causal_ms"]
        except Exception as e:  # a configuration that does not compile or fit must not lose the others
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        results.append(row)
        print(row, flush=True)
    return results


def kv_write_sweep(cfg: ModelConfig, tokens: int) -> list[dict]:
    """The cache write alone (rotated keys and values of every position) per block of positions, over the
    model's layers."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * cfg.head_dim
    qkv = torch.randn(cfg.num_lanes, tokens, rows, device=device, dtype=dtype)
    k_cache = torch.zeros(
        cfg.num_kv_heads, cfg.max_position_embeddings, cfg.head_dim, device=device, dtype=dtype
    )
    v_cache = torch.zeros_like(k_cache)
    cos, sin = rope_tables(cfg, device)
    out = []
    for block_t in (16, 32, 64, 128, 256):

        def run(block_t=block_t):
            launch_prefill_kv_write(qkv, k_cache, v_cache, cos, sin, num_heads=cfg.num_heads, interleaved=True,
                                    k_norm=None, eps=cfg.norm_eps, block_t=block_t)  # fmt: skip

        try:
            out.append({"block_t": block_t, "model_ms": median_ms(run) * cfg.num_layers})
        except Exception as e:
            out.append({"block_t": block_t, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200]})
    return out


def silu_mul_sweep(cfg: ModelConfig, tokens: int) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = (cfg.num_lanes, tokens, cfg.ffn_per_lane)
    gate, up = torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)
    out = {"eager_ms": median_ms(lambda: F.silu(gate) * up) * cfg.num_layers}
    try:
        from kernels.silu_mul import silu_mul
    except ImportError as e:
        out["fused"] = f"not available: {e}"
        return out
    buf = torch.empty_like(gate)
    out["fused_ms"] = median_ms(lambda: silu_mul(gate, up, buf)) * cfg.num_layers
    out["max_diff"] = (silu_mul(gate, up).float() - (F.silu(gate) * up).float()).abs().max().item()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="laneformer-2b", help="a preset")
    parser.add_argument("--tokens", type=int, default=4094)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("prefill_sweep"):
        return 2
    cfg = ModelConfig.from_hf(preset_config(args.model))
    result = {"model": args.model, "tokens": args.tokens, "silu_mul": silu_mul_sweep(cfg, args.tokens),
              "kv_write": kv_write_sweep(cfg, args.tokens), "attention": attention_sweep(cfg, args.tokens)}  # fmt: skip
    print(json.dumps(result["silu_mul"]))
    print(json.dumps(result["kv_write"]))
    for row in sorted(result["attention"], key=lambda r: r.get("model_ms", 1e9)):
        print(row)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
