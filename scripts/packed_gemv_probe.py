"""The matrix-vector kinds of a decode layer over 12-bit packed weights (kernels/packed_gemv.py) against the bf16
kernels the fast runner uses, on a preset's shapes with random weights: first each packed kind against the bf16
product (max relative error), then each kind alone in a few launch settings (its launches in one CUDA graph, one
a layer, each waiting on the one before), then us a layer of q|k|v -> o-proj -> gate/up -> down-proj for all the
preset's layers in one graph (attention left out), all bf16, all packed with each kind's fastest setting, and
mixes, in turns.

    python scripts/packed_gemv_probe.py --model qwen3-1.7b [--json out.json]
    python scripts/packed_gemv_probe.py --model qwen3-1.7b --compile   # no GPU: registers of each kind, sm_90a

One-lane presets only (Llama, Qwen3, Qwen2 without its q|k|v bias). kernels/NOTES.md round 33 has the figures.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

if "--compile" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.config import ModelConfig  # noqa: E402
from inference.presets import preset_config  # noqa: E402
from kernels.packed_gemv import PackedWeight, pack_weight, packed_gemv, pick_tile_k  # noqa: E402

# Packed launch settings tried for each kind, (block_n, num_warps, prefetch, row_blocks, x_2d); the chain runs the
# fastest of each kind alone. The o-proj loads all its tiles before its wait, as the bf16 one does.
CANDIDATES = {
    "qkv": ((8, 4, 1, 1, 1), (8, 4, 1, 1, 0), (4, 4, 1, 2, 0), (4, 4, 1, 1, 0), (2, 4, 1, 2, 1)),
    "o": ((8, 4, 8, 1, 1), (8, 4, 8, 1, 0), (4, 4, 8, 1, 1), (2, 2, 8, 2, 1), (8, 8, 8, 1, 1)),
    "gate_up": (
        (4, 4, 1, 1, 1),
        (4, 4, 1, 1, 0),
        (2, 2, 1, 2, 1),
        (2, 4, 1, 2, 1),
        (2, 4, 1, 3, 0),
        (8, 8, 1, 1, 1),
    ),
    "down": ((1, 4, 1, 4, 1), (1, 4, 1, 4, 0), (1, 4, 1, 2, 1), (1, 4, 1, 8, 1), (2, 8, 1, 2, 1)),
}


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, hd = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    return {"qkv": (qkv, d), "o": (d, cfg.num_heads * hd), "gate_up": (cfg.intermediate_size, d),
            "down": (d, cfg.intermediate_size)}  # fmt: skip


class Layer:
    """One layer's four weights, bf16 ([1, N, K], as the runner keeps them) and packed."""

    def __init__(self, cfg: ModelConfig, device: torch.device, generator: torch.Generator) -> None:
        self.bf16 = {}
        for kind, (n, k) in shapes(cfg).items():
            for name in (kind, "up") if kind == "gate_up" else (kind,):
                w = torch.empty(1, n, k, device=device).normal_(0.0, k**-0.5, generator=generator)
                self.bf16[name] = w.to(torch.bfloat16)
        self.packed = {name: pack_weight(w[0]) for name, w in self.bf16.items()}
        self.norm = torch.ones(cfg.hidden_size, device=device, dtype=torch.bfloat16)


class Buffers:
    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        n_qkv = shapes(cfg)["qkv"][0]
        self.x = torch.randn(1, cfg.hidden_size, device=device)  # the fp32 residual
        self.qkv = torch.zeros(1, n_qkv, device=device, dtype=torch.bfloat16)
        self.h = torch.zeros(1, cfg.intermediate_size, device=device, dtype=torch.bfloat16)
        self.attn = self.qkv[
            :, : cfg.num_heads * cfg.head_dim
        ]  # the o-proj's input stands in for attention's


def bf16_layer(layer: Layer, buf: Buffers, eps: float, only: str | None = None) -> None:
    """The runner's one-lane settings (inference/fast/settings.py): q|k|v and o-proj trigger early, the o-proj
    loads all its tiles before its wait, the gate/up pair 3."""
    from kernels.lane_reduce_gemv import lane_reduce_gemv
    from kernels.rmsnorm_gemv import rmsnorm_gemv

    w = layer.bf16
    if only in (None, "qkv"):
        rmsnorm_gemv(
            buf.x, w["qkv"], buf.qkv, norm_weight=layer.norm, eps=eps, use_pdl=True, trigger_early=True
        )
    if only in (None, "o"):
        lane_reduce_gemv(buf.attn, w["o"], buf.x, use_pdl=True, trigger_early=True, prefetch=64)
    if only in (None, "gate_up"):
        rmsnorm_gemv(buf.x, w["gate_up"], buf.h, norm_weight=layer.norm, eps=eps, weight_up=w["up"], use_pdl=True,
                     prefetch=3)  # fmt: skip
    if only in (None, "down"):
        lane_reduce_gemv(buf.h, w["down"], buf.x, use_pdl=True)


def packed_layer(layer: Layer, buf: Buffers, eps: float, settings: dict, only: str | None = None) -> None:
    """settings: kind -> (block_n, num_warps, prefetch, row_blocks, x_2d)."""
    p = layer.packed

    def launch(kind: str, x, weight: PackedWeight, out, **kwargs) -> None:
        block_n, warps, prefetch, row_blocks, x_2d = settings[kind]
        packed_gemv(x, weight, out, use_pdl=True, block_n=block_n, num_warps=warps, prefetch=prefetch,
                    row_blocks=row_blocks, x_2d=bool(x_2d), **kwargs)  # fmt: skip

    if only in (None, "qkv"):
        launch("qkv", buf.x[0], p["qkv"], buf.qkv[0], norm_weight=layer.norm, eps=eps, trigger_early=True)
    if only in (None, "o"):
        launch("o", buf.attn[0], p["o"], buf.x[0], accumulate=True, trigger_early=True)
    if only in (None, "gate_up"):
        launch(
            "gate_up", buf.x[0], p["gate_up"], buf.h[0], norm_weight=layer.norm, eps=eps, weight_up=p["up"]
        )
    if only in (None, "down"):
        launch("down", buf.h[0], p["down"], buf.x[0], accumulate=True)


def graph_us(step) -> float:
    """us of one step() replayed in a CUDA graph."""
    from inference.bench.timing import median_ms

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return median_ms(graph.replay, repeats=20) * 1e3


def check(layer: Layer, buf: Buffers, eps: float) -> dict[str, float]:
    """Max relative error of each packed kind against the bf16 weights' fp32 product on the same input."""
    w, p, errors = layer.bf16, layer.packed, {}
    x = buf.x[0].clone()
    h = x * torch.rsqrt(x.pow(2).mean() + eps) * layer.norm.float()
    act = torch.randn(layer.bf16["down"].shape[-1], device=x.device)  # the down-proj's K, the widest input
    for kind, inp, normed in (("qkv", x, True), ("o", act[: p["o"].shape[1]], False),
                              ("gate_up", x, True), ("down", act, False)):  # fmt: skip
        n = p[kind].shape[0]
        out = torch.zeros(n, device=x.device)
        kwargs = {"norm_weight": layer.norm, "eps": eps} if normed else {}
        if kind == "gate_up":
            kwargs["weight_up"] = p["up"]
        packed_gemv(inp, p[kind], out, **kwargs)
        ref = w[kind][0].float() @ (h if normed else inp)
        if kind == "gate_up":
            ref = torch.nn.functional.silu(ref) * (w["up"][0].float() @ h)
        errors[kind] = ((out - ref).abs().max() / ref.abs().max()).item()
    return errors


def compile_only(cfg: ModelConfig) -> None:
    """Registers, spills and 16-byte loads of each packed kind, compiled for sm_90a here (no GPU)."""
    from triton.runtime.jit import JITFunction

    import kernels.packed_gemv as module
    from scripts.kernel_report import compile_report

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    module.interpreted = lambda: False
    meta = torch.device("meta")

    def fake(n: int, k: int) -> PackedWeight:
        i32 = {"dtype": torch.int32, "device": meta}
        return PackedWeight(torch.empty(n, k // 4, **i32), torch.empty(n, k // 8, **i32), torch.empty(n, **i32),
                            torch.empty(n, 4, **i32), torch.empty(n, 4, device=meta), pick_tile_k(k))  # fmt: skip

    for kind, (n, k) in shapes(cfg).items():
        for block_n, warps, prefetch, row_blocks, x_2d in CANDIDATES[kind]:
            x = torch.empty(k, device=meta, dtype=torch.bfloat16)
            out = torch.empty(
                n, device=meta, dtype=torch.float32 if kind in ("o", "down") else torch.bfloat16
            )
            normed = kind in ("qkv", "gate_up")
            kwargs = {"norm_weight": torch.empty(k, device=meta, dtype=torch.bfloat16)} if normed else {}
            if kind == "gate_up":
                kwargs["weight_up"] = fake(n, k)
            packed_gemv(x, fake(n, k), out, accumulate=not normed, use_pdl=True, block_n=block_n, num_warps=warps,
                        prefetch=prefetch, row_blocks=row_blocks, x_2d=bool(x_2d), **kwargs)  # fmt: skip
            fn, args, kw = launches.pop()
            report = compile_report(fn, args, kw, warps).split("regs")[1].split("{")[0]
            ptx = Path(f"/tmp/kernel_report_{fn.__name__}.ptx").read_text()
            shared = ptx.count("ld.shared") + ptx.count("st.shared")
            print(
                f"{kind:8s} {(block_n, warps, prefetch, row_blocks, x_2d)} regs{report} shared ld/st {shared} "
                f"bar.sync {ptx.count('bar.sync')}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = ModelConfig.from_hf(preset_config(args.model))
    if cfg.num_lanes != 1 or cfg.qkv_bias:
        raise SystemExit(f"{args.model}: the probe takes one-lane presets without a q|k|v bias")
    if args.compile:
        compile_only(cfg)
        return 0
    from inference.bench.ceiling import measure_bandwidth
    from inference.bench.model_setup import cuda_missing

    if cuda_missing("packed_gemv_probe"):
        return 2
    device = torch.device("cuda")
    read_gbs = measure_bandwidth(device)["read_gbs"]
    generator = torch.Generator(device).manual_seed(0)
    layers = [Layer(cfg, device, generator) for _ in range(cfg.num_layers)]
    buf = Buffers(cfg, device)
    eps = cfg.norm_eps
    bf16_bytes = sum(w.numel() * 2 for w in layers[0].bf16.values())
    packed_bytes = sum(p.nbytes() for p in layers[0].packed.values())
    exceptions = sum(p.exceptions for p in layers[0].packed.values())
    result = {"model": args.model, "read_gbs": read_gbs, "bf16_bytes_layer": bf16_bytes,
              "packed_bytes_layer": packed_bytes, "exceptions_layer": exceptions, "errors": check(layers[0], buf, eps),
              "chain": [], "alone": []}  # fmt: skip
    print(f"{args.model}: read {read_gbs:,.0f} GB/s; a layer's four kinds {bf16_bytes / 1e6:.1f} MB bf16, "
          f"{packed_bytes / 1e6:.1f} MB packed ({exceptions} exceptions); packed vs bf16 product, max rel err "
          + ", ".join(f"{k} {v:.1e}" for k, v in result["errors"].items()))  # fmt: skip

    def kind_bytes(kind: str, packed: bool) -> int:
        names = (kind, "up") if kind == "gate_up" else (kind,)
        if packed:
            return sum(layers[0].packed[name].nbytes() for name in names)
        return sum(layers[0].bf16[name].numel() * 2 for name in names)

    # each kind alone: 28 (the preset's layers) launches in a graph, each waiting on the one before (PDL)
    print(f"\nalone, us a call ({cfg.num_layers} layers' weights in a graph; % of the read bw for its bytes)")
    best = {}
    for kind in shapes(cfg):
        line = []
        us = (
            graph_us(lambda kind=kind: [bf16_layer(layer, buf, eps, kind) for layer in layers])
            / cfg.num_layers
        )
        result["alone"].append({"kind": kind, "settings": "bf16", "us": us})
        line.append(f"bf16 {us:6.2f} ({100 * kind_bytes(kind, False) / us / 1e3 / read_gbs:4.1f}%)")
        for cand in CANDIDATES[kind]:
            settings = {kind: cand}
            try:
                us = (
                    graph_us(
                        lambda kind=kind, settings=settings: [
                            packed_layer(layer, buf, eps, settings, kind) for layer in layers
                        ]
                    )
                    / cfg.num_layers
                )
            except Exception as error:  # a setting that does not build is reported, not fatal
                line.append(f"{cand} failed: {str(error)[:80]}")
                continue
            result["alone"].append({"kind": kind, "settings": list(cand), "us": us})
            line.append(f"{cand} {us:6.2f} ({100 * kind_bytes(kind, True) / us / 1e3 / read_gbs:4.1f}%)")
            if kind not in best or us < best[kind][1]:
                best[kind] = (cand, us)
        print(f"{kind:8s} " + "  ".join(line))

    settings = {kind: cand for kind, (cand, _) in best.items()}
    result["best"] = {kind: list(cand) for kind, cand in settings.items()}
    print(f"fastest packed settings alone: {settings}")

    def mixed(packed_kinds: tuple[str, ...]):
        def run(layer: Layer) -> None:
            for kind in shapes(cfg):
                if kind in packed_kinds:
                    packed_layer(layer, buf, eps, settings, kind)
                else:
                    bf16_layer(layer, buf, eps, kind)

        nbytes = sum(kind_bytes(kind, kind in packed_kinds) for kind in shapes(cfg))
        return run, nbytes

    rows = [("bf16 (the runner's kernels)", lambda layer: bf16_layer(layer, buf, eps), bf16_bytes)]
    for packed_kinds in (tuple(shapes(cfg)), ("qkv", "o"), ("gate_up", "down"), ("qkv", "o", "down")):
        run, nbytes = mixed(packed_kinds)
        rows.append(("packed " + "+".join(packed_kinds), run, nbytes))
    print(f"\n{'chain, us a layer (' + str(cfg.num_layers) + ' layers in a graph)':58s} {'us':>7s} {'ideal':>7s} "
          f"{'% bw':>6s}")  # fmt: skip
    for rounds in range(3):  # in turns
        for name, run, nbytes in rows:
            us = graph_us(lambda run=run: [run(layer) for layer in layers]) / cfg.num_layers
            ideal = nbytes / read_gbs / 1e3
            result["chain"].append({"variant": name, "round": rounds, "us": us, "ideal_us": ideal})
            print(f"{name[:58]:58s} {us:7.2f} {ideal:7.2f} {100 * ideal / us:6.1f}")
    medians = {}
    for row in result["chain"]:
        medians.setdefault(row["variant"][:40], []).append(row["us"])
    print("chain medians: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in medians.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
