"""kernels/staged_gemv.py against the register-tiled kernels it may replace, on a model's matrix shapes (GPU only).

    python scripts/staged_probe.py --model llama-3.2-1b [--config 16/256/8/4 ...] [--json out.json]

For each one-lane matrix-vector kind (q|k|v, o-proj, gate/up, down-proj): the largest error of both kernels
against an fp32 PyTorch reference, then GB/s of weights read, one launch after another in a CUDA graph over as
many copies of the weights as the model has layers (so no launch finds its weights in L2), without PDL: the
kernels' own streaming rate, not their boundaries. A config is box_r/box_c/stages/num_warps (0: automatic).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.bench import cuda_missing, measure_bandwidth  # noqa: E402
from inference.config import ModelConfig  # noqa: E402
from inference.presets import preset_config  # noqa: E402
from kernels.lane_reduce_gemv import lane_reduce_gemv  # noqa: E402
from kernels.rmsnorm_gemv import rmsnorm_gemv  # noqa: E402
from kernels.staged_gemv import staged_gemv  # noqa: E402


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """kind -> (N, K) of one lane's matrix (gate/up: each of the two)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, d), "o": (d, cfg.num_heads * hd),
            "gate_up": (cfg.intermediate_size, d), "down": (d, cfg.intermediate_size)}  # fmt: skip


def graph_us(launches, repeats: int = 20) -> float:
    """Median us of one pass of `launches` (replayed as a CUDA graph)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            launches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def probe_kind(kind: str, n: int, k: int, layers: int, configs: list[tuple[int, ...]], device) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    gated, residual = kind == "gate_up", kind in ("o", "down")
    ws = [torch.randn(n, k, device=device, generator=gen).mul_(0.02).bfloat16() for _ in range(layers)]
    ups = (
        [torch.randn(n, k, device=device, generator=gen).mul_(0.02).bfloat16() for _ in range(layers)]
        if gated
        else None
    )
    x = torch.randn(k, device=device, generator=gen) * (1.0 if residual else 3.0)
    act = x.bfloat16() if residual else x
    g = (1 + 0.1 * torch.randn(k, device=device, generator=gen)).bfloat16()
    eps = 1e-5

    # fp32 reference of layer 0
    if residual:
        ref = ws[0].float() @ act.float()
    else:
        h = x / torch.sqrt(x.pow(2).mean() + eps) * g.float()
        ref = ws[0].float() @ h
        if gated:
            ref = torch.nn.functional.silu(ref) * (ups[0].float() @ h)
    scale = ref.abs().max().item()
    base = torch.randn(n, device=device, generator=gen)

    def triton_once(i: int, out: torch.Tensor) -> None:
        if residual:
            lane_reduce_gemv(act[None], ws[i][None], out[None], mode="sum")
        else:
            rmsnorm_gemv(x[None], ws[i][None], out[None], norm_weight=g, eps=eps,
                         weight_up=ups[i][None] if gated else None)  # fmt: skip

    def staged_once(i: int, out: torch.Tensor, cfg: tuple[int, ...], descs: dict) -> None:
        box_r, box_c, stages, warps, share = (*cfg, 0)[:5]
        staged_gemv(act if residual else x, ws[i], out, norm_weight=None if residual else g, eps=eps,
                    weight_up=ups[i] if gated else None, residual=residual, box_r=box_r or None,
                    box_c=box_c or None, stages=stages or None, num_warps=warps or 4, share_kb=share or None,
                    descriptors=descs)  # fmt: skip

    def fresh_out() -> torch.Tensor:
        return base.clone() if residual else torch.zeros(n, device=device, dtype=torch.bfloat16)

    rows = []
    bytes_per_pass = layers * n * k * 2 * (2 if gated else 1)
    out = fresh_out()
    triton_once(0, out)
    got = out.float() - (base if residual else 0)
    rows.append({"kind": kind, "kernel": "triton", "max_err_rel": (got - ref).abs().max().item() / scale,
                 "us_per_launch": graph_us(lambda: [triton_once(i, out) for i in range(layers)]) / layers})  # fmt: skip
    for cfg in configs:
        descs: dict = {}
        out = fresh_out()
        try:
            staged_once(0, out, cfg, descs)
            torch.cuda.synchronize()
        except Exception as error:  # a config the kernel refuses or cannot build: say so, keep probing
            rows.append(
                {"kind": kind, "kernel": f"staged {cfg}", "error": f"{type(error).__name__}: {error}"[:300]}
            )
            continue
        got = out.float() - (base if residual else 0)
        us = (
            graph_us(
                lambda cfg=cfg, descs=descs, out=out: [staged_once(i, out, cfg, descs) for i in range(layers)]
            )
            / layers
        )
        rows.append({"kind": kind, "kernel": f"staged {cfg}", "max_err_rel": (got - ref).abs().max().item() / scale,
                     "us_per_launch": us})  # fmt: skip
    for r in rows:
        if "us_per_launch" in r:
            r["gbs"] = bytes_per_pass / layers / r["us_per_launch"] / 1e3
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--config", action="append", default=[], help="box_r/box_c/stages/num_warps (0: auto)"
    )
    parser.add_argument("--kinds", default="qkv,o,gate_up,down")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("staged_probe"):
        return 2
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device, gib=2)
    cfg = ModelConfig.from_hf(preset_config(args.model))
    configs = [tuple(int(v) for v in c.split("/")) for c in args.config] or [(0, 0, 0, 0)]
    rows = []
    print(f"{args.model}: read bandwidth {bandwidth['read_gbs']:,.0f} GB/s")
    for kind, (n, k) in shapes(cfg).items():
        if kind not in args.kinds.split(","):
            continue
        for r in probe_kind(kind, n, k, cfg.num_layers, configs, device):
            rows.append(r)
            if "error" in r:
                print(f"  {kind:8s} {r['kernel']:28s} {r['error']}")
            else:
                print(f"  {kind:8s} {r['kernel']:28s} err {r['max_err_rel']:.1e}  {r['us_per_launch']:7.2f} us"
                      f"  {r['gbs']:6,.0f} GB/s ({100 * r['gbs'] / bandwidth['read_gbs']:.0f}%)")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"model": args.model, "bandwidth": bandwidth, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
