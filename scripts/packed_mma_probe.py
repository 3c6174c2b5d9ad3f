"""The 12-bit packed weights of kernels/packed_gemv.py with the products on the tensor cores: each thread's
decoded bf16 pairs go straight into `mma.sync.m16n8k16` as A fragments, so the fp32 split of each pair and the
FFMA per weight are gone (~2.3 instructions a weight where kernels/packed_gemv.py needs ~8). A decode layer of
qwen3-1.7b's shapes (q|k|v, o-proj, gate/up, down-proj; attention left out, a fixed bf16 vector in its place), 28
layers in one CUDA graph: first one layer checked against the runner's bf16 kernels, then each kind alone in a
few settings, then the chain all packed, half packed (o-proj and down-proj) and all bf16, in turns.

    python scripts/packed_mma_probe.py [--json out.json]     # GPU
    python scripts/packed_mma_probe.py --compile             # no GPU: registers and layout conversions, sm_90a

Layout: kernels/packed_mma_gemv.py's (pack_mma; its docstring), which the runner's o-proj and down-proj now run
on; this probe keeps the kinds the runner does not have yet. Its kernel takes 1 / SPLIT of K and adds into an fp32
output with atomics when SPLIT > 1. A normed kind builds B from
the fp32 x * g in a bf16 hi and lo part (two mma a K-part). Exceptions (weights under the 16-binade window,
~1e-4) are decoded to the window's floor here: the check compares with that matrix, both paths run on it, and
the timing leaves their correction out.
"""

import argparse
import json
import os
import sys
from pathlib import Path

if "--compile" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402,F401 - decides the interpreter (no GPU) before triton's own jit functions exist

# isort: split
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from kernels.packed_gemv import bf16_pair, encode_rows, high_bytes, row_floors  # noqa: E402
from kernels.packed_mma_gemv import MMA4, MMA4_SPLIT_B, chunk_loads, hi_lo_pairs, pack_mma, program_tiles  # noqa: E402


def pack_floored(weight: torch.Tensor, normed: bool = False) -> dict:
    """kernels/packed_mma_gemv.py's packing as the probe's kernels read it: the words and bases (they leave the
    exceptions' correction out) and the matrix they decode to, exceptions at their row's floor."""
    packed = pack_mma(weight, normed=normed)
    bits, _, _, base, exception = encode_rows(weight)
    decoded = torch.where(exception, row_floors(base)[:, None], bits)
    return {"lo": packed.lo, "codes": packed.codes, "base": packed.base, "n": packed.n, "k": packed.k,
            "decoded": decoded.to(torch.int16).view(torch.bfloat16)}  # fmt: skip


@triton.jit
def _mma_chunk(words, base, bh0, bh1, bl0, bl1, acc, SPLIT_B: tl.constexpr):
    """acc after chunk `words` (lo0, lo1, codes: 4 K-parts a thread) against B (hi and, with SPLIT_B, lo)."""
    lo0, lo1, codes = words
    h0 = high_bytes(codes, base, 0)
    h1 = high_bytes(codes, base, 1)
    a = [bf16_pair(lo0, h0, 0, True), bf16_pair(lo0, h0, 1, True), bf16_pair(lo1, h1, 0, True),
         bf16_pair(lo1, h1, 1, True)]  # fmt: skip
    if SPLIT_B:
        return tl.inline_asm_elementwise(MMA4_SPLIT_B, "=&f,=&f,=&f,=&f," + "r," * 32 + "f,f,f,f",
                                         a + [bh0, bh1, bl0, bl1, acc], dtype=tl.float32, is_pure=True,
                                         pack=4)  # fmt: skip
    return tl.inline_asm_elementwise(MMA4, "=&f,=&f,=&f,=&f," + "r," * 24 + "f,f,f,f", a + [bh0, bh1, acc],
                                     dtype=tl.float32, is_pure=True, pack=4)  # fmt: skip


@triton.jit
def _normed_b(x_ptr, norm_ptr, col, mask):
    """B pairs (hi part, lo part) of x * g at columns col and col + 4 (chunk_columns' normed order): each an
    int32 of two bf16."""
    first = tl.load(x_ptr + col, mask=mask, other=0.0) * tl.load(norm_ptr + col, mask=mask, other=0.0).to(
        tl.float32
    )
    second = tl.load(x_ptr + col + 4, mask=mask, other=0.0) * tl.load(
        norm_ptr + col + 4, mask=mask, other=0.0
    ).to(tl.float32)
    return hi_lo_pairs(first, second)


@triton.jit
def _mma_split_kernel(act_ptr, x_ptr, norm_ptr, lo_ptr, code_ptr, base_ptr, lo_u_ptr, code_u_ptr, base_u_ptr,
                      out_ptr, zero_ptr, eps, K: tl.constexpr, BM: tl.constexpr, AHEAD: tl.constexpr,
                      SPLIT: tl.constexpr, NORMED: tl.constexpr, GATED: tl.constexpr, ACCUMULATE: tl.constexpr,
                      ZERO: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER_EARLY: tl.constexpr):  # fmt: skip
    """BM M-tiles a program (a warp each), 1 / SPLIT of K; SPLIT > 1 adds into an fp32 out with atomics. NORMED:
    B is x * g in a bf16 hi and lo part, computed here from the fp32 x, and rstd scales the sums. ZERO: each
    program also clears its ZERO floats of zero_ptr (a buffer the next launches add into)."""
    CHUNKS: tl.constexpr = K // 64 // SPLIT
    k0, m, g, t, j, tile, code_tile = program_tiles(K, BM, SPLIT)
    base = tl.load(base_ptr + m[:, None] * 8 + g[None, :])
    base_u = base
    if GATED:
        base_u = tl.load(base_u_ptr + m[:, None] * 8 + g[None, :])
    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    ring = ()
    ring_u = ()
    for i in tl.static_range(AHEAD):
        ring = ring + (chunk_loads(lo_ptr, code_ptr, tile, code_tile, i),)
        if GATED:
            ring_u = ring_u + (chunk_loads(lo_u_ptr, code_u_ptr, tile, code_tile, i),)
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()
    if ZERO > 0:
        pid = tl.program_id(0) * SPLIT + tl.program_id(1)
        tl.store(zero_ptr + pid * ZERO + tl.arange(0, ZERO), tl.zeros([ZERO], tl.float32))
    rstd = 1.0
    if NORMED:
        xs = tl.load(x_ptr + tl.arange(0, K))
        rstd = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / K + eps)
    acc = tl.zeros([BM, 128], dtype=tl.float32) + (base * 0).to(tl.float32)
    acc_u = acc
    column_0 = (g == 0)[None, :] & (m >= 0)[:, None]
    for i in tl.static_range(CHUNKS):
        words = ring[0]
        ring = ring[1:]
        if i + AHEAD < CHUNKS:
            ring = ring + (chunk_loads(lo_ptr, code_ptr, tile, code_tile, i + AHEAD),)
        if GATED:
            words_u = ring_u[0]
            ring_u = ring_u[1:]
            if i + AHEAD < CHUNKS:
                ring_u = ring_u + (chunk_loads(lo_u_ptr, code_u_ptr, tile, code_tile, i + AHEAD),)
        if NORMED:
            col = ((k0 + i) * 64 + 8 * t + j)[None, :] + (m * 0)[:, None]
            bh0, bl0 = _normed_b(x_ptr, norm_ptr, col, column_0)
            bh1, bl1 = _normed_b(x_ptr, norm_ptr, col + 32, column_0)
        else:
            pair = ((k0 + i) * 32 + 4 * t + j)[None, :] + (m * 0)[:, None]
            bh0 = tl.load(act_ptr + pair, mask=column_0, other=0)
            bh1 = tl.load(act_ptr + pair + 16, mask=column_0, other=0)
            bl0 = bh0
            bl1 = bh1
        acc = _mma_chunk(words, base, bh0, bh1, bl0, bl1, acc, NORMED)
        if GATED:
            acc_u = _mma_chunk(words_u, base_u, bh0, bh1, bl0, bl1, acc_u, NORMED)
    rows = m[:, None] * 16 + g[None, :] + 8 * (j[None, :] // 2)
    keep = ((t == 0) & (j % 2 == 0))[None, :] & (rows >= 0)
    y = acc * rstd
    if GATED:
        y = y * tl.sigmoid(y) * (acc_u * rstd)
    if SPLIT > 1:
        tl.atomic_add(out_ptr + rows, y, mask=keep, sem="relaxed")
    else:
        if ACCUMULATE:
            y += tl.load(out_ptr + rows, mask=keep, other=0.0)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=keep)


def mma_split_launch(packed: dict, out: torch.Tensor, *, act=None, x=None, norm=None, packed_up=None,
                     accumulate=False, split=1, block_m=4, ahead=8, zero=None, trigger_early=False,
                     eps=1e-6) -> None:  # fmt: skip
    n, k = packed["n"], packed["k"]
    if (k // 64) % split or (n // 16) % block_m or (split > 1 and (out.dtype != torch.float32 or packed_up)):
        raise ValueError(f"split {split} / block_m {block_m} do not fit [{n} x {k}]")
    up = packed_up or packed
    grid = ((n // 16) // block_m, split)
    zero_each = 0
    if zero is not None:
        zero_each = zero.numel() // (grid[0] * grid[1])
        if zero_each * grid[0] * grid[1] != zero.numel() or zero_each & (zero_each - 1):
            raise ValueError(f"zero: {zero.numel()} floats over {grid[0] * grid[1]} programs")
    normed = norm is not None
    _mma_split_kernel[grid](act.view(torch.int32) if act is not None else out, x if normed else out,
                            norm if normed else out, packed["lo"], packed["codes"], packed["base"], up["lo"],
                            up["codes"], up["base"], out, zero if zero is not None else out, eps, K=k, BM=block_m,
                            AHEAD=min(ahead, k // 64 // split), SPLIT=split, NORMED=normed,
                            GATED=packed_up is not None, ACCUMULATE=accumulate, ZERO=zero_each, USE_PDL=True,
                            TRIGGER_EARLY=trigger_early, num_warps=block_m, launch_pdl=True)  # fmt: skip


ALONE_SETTINGS = {  # per kind: (block_m, split, ahead)
    "qkv": ((1, 8, 4), (1, 16, 2)),
    "o": ((1, 8, 4), (1, 4, 8), (1, 16, 2), (1, 32, 1)),
    "gate_up": ((4, 1, 4), (2, 1, 4)),
    "down": ((1, 8, 8), (1, 16, 4), (1, 32, 2), (2, 16, 4), (1, 12, 8)),
}


def chain(json_path) -> int:
    """qwen3-1.7b's four matrix kinds, 28 layers, attention left out (the o-proj reads a fixed bf16 vector in
    its place): the runner's bf16 kernels against the packed tensor-core launches, each kind alone in a few
    settings, then the layer chain in one CUDA graph, in turns."""
    from types import SimpleNamespace

    from inference.bench.ceiling import measure_bandwidth
    from scripts.packed_gemv_probe import bf16_layer, graph_us

    device = torch.device("cuda")
    read_gbs = measure_bandwidth(device)["read_gbs"]
    gen = torch.Generator(device).manual_seed(0)
    d, qkv_rows, inter, layers_n = 2048, 4096, 6144, 28
    shapes = {"qkv": (qkv_rows, d), "o": (d, d), "gate_up": (inter, d), "up": (inter, d), "down": (d, inter)}
    layers = []
    for _ in range(layers_n):
        raw = {k: (torch.randn(n, kk, device=device, generator=gen) * kk**-0.5).to(torch.bfloat16)
               for k, (n, kk) in shapes.items()}  # fmt: skip
        packed = {k: pack_floored(w, normed=k in ("qkv", "gate_up", "up")) for k, w in raw.items()}
        # the bf16 kernels run on the decoded matrices (exceptions at their floor), so both compute the same sums
        bf16 = {k: packed[k]["decoded"][None].contiguous() for k in raw}
        norm = (1 + 0.1 * torch.randn(d, device=device, generator=gen)).to(torch.bfloat16)
        layers.append(SimpleNamespace(bf16=bf16, packed=packed, norm=norm))
    eps = 1e-6
    x0 = torch.randn(d, device=device, generator=gen)
    attn = torch.randn(d, device=device, generator=gen).to(torch.bfloat16)  # attention's output, stood in
    buf = SimpleNamespace(x=x0[None].clone(), qkv=torch.zeros(1, qkv_rows, device=device, dtype=torch.bfloat16),
                          h=torch.zeros(1, inter, device=device, dtype=torch.bfloat16), attn=attn[None])  # fmt: skip
    x, h = buf.x[0], buf.h[0]  # the residual and the MLP's activation, shared with the bf16 kernels
    qkv32 = torch.zeros(qkv_rows, device=device)  # q|k|v in fp32, added into by the splits

    def launch(kind: str, layer, setting) -> None:
        block_m, split, ahead = setting
        p = layer.packed
        if kind == "qkv":
            mma_split_launch(p["qkv"], qkv32, x=x, norm=layer.norm, split=split, block_m=block_m, ahead=ahead,
                             trigger_early=True, eps=eps)  # fmt: skip
        elif kind == "o":
            mma_split_launch(p["o"], x, act=attn, accumulate=True, split=split, block_m=block_m, ahead=ahead,
                             zero=qkv32, trigger_early=True)  # fmt: skip
        elif kind == "gate_up":
            mma_split_launch(p["gate_up"], h, x=x, norm=layer.norm, packed_up=p["up"], block_m=block_m,
                             ahead=ahead, eps=eps)  # fmt: skip
        else:
            mma_split_launch(p["down"], x, act=h, accumulate=True, split=split, block_m=block_m, ahead=ahead)

    def mma_step(settings: dict) -> None:
        for layer in layers:
            for kind in ("qkv", "o", "gate_up", "down"):
                launch(kind, layer, settings[kind])

    # one layer both ways from the same residual: q|k|v and the final residual agree to bf16 rounding
    first = {"qkv": (1, 8, 4), "o": (1, 8, 4), "gate_up": (4, 1, 4), "down": (1, 8, 8)}
    for kind in ("qkv", "o", "gate_up", "down"):
        launch(kind, layers[0], first[kind])
    packed_x = x.clone()
    x.copy_(x0)
    bf16_layer(layers[0], buf, eps)
    err = ((packed_x - x).norm() / (x - x0).norm()).item()
    print(
        f"read {read_gbs:,.0f} GB/s; one layer, packed tensor-core vs the bf16 kernels: |dx| / |update| {err:.1e}"
    )
    x.copy_(x0)
    qkv32.zero_()
    mma_split_launch(layers[0].packed["qkv"], qkv32, x=x, norm=layers[0].norm, split=8, block_m=1, eps=eps)
    bf16_layer(layers[0], buf, eps, "qkv")
    err_qkv = ((qkv32 - buf.qkv[0].float()).norm() / buf.qkv[0].float().norm()).item()
    print(f"q|k|v alone: {err_qkv:.1e}")
    result = {"read_gbs": read_gbs, "err": err, "err_qkv": err_qkv, "alone": [], "chain": []}
    best = {}
    for kind, candidates in ALONE_SETTINGS.items():
        line = f"{kind:8s} bf16 {graph_us(lambda kind=kind: [bf16_layer(ly, buf, eps, kind) for ly in layers]) / layers_n:6.2f}"
        for setting in candidates:
            try:
                us = graph_us(lambda kind=kind, setting=setting: [launch(kind, ly, setting) for ly in layers])
            except Exception as error:
                line += f"  {setting} failed {str(error)[:60]}"
                continue
            us /= layers_n
            result["alone"].append({"kind": kind, "setting": list(setting), "us": us})
            line += f"  {setting} {us:6.2f}"
            if kind not in best or us < best[kind][1]:
                best[kind] = (setting, us)
        print(line)
    fastest = {kind: setting for kind, (setting, _) in best.items()}
    print(f"fastest alone: {fastest}")
    bf16_bytes = sum(w.numel() * 2 for w in layers[0].bf16.values())
    packed_bytes = sum(
        p[key].numel() * 4 for p in layers[0].packed.values() for key in ("lo", "codes", "base")
    )

    def hybrid_step() -> None:  # the packed o-proj and down-proj, the bf16 normed kinds
        for layer in layers:
            bf16_layer(layer, buf, eps, "qkv")
            launch("o", layer, fastest["o"])
            bf16_layer(layer, buf, eps, "gate_up")
            launch("down", layer, fastest["down"])

    hybrid_bytes = sum(layers[0].bf16[key].numel() * 2 for key in ("qkv", "gate_up", "up")) + sum(
        layers[0].packed[kind][key].numel() * 4 for kind in ("o", "down") for key in ("lo", "codes", "base")
    )
    rows = [("bf16 (the runner's kernels)", lambda: [bf16_layer(layer, buf, eps) for layer in layers], bf16_bytes),
            (f"packed mma {fastest}", lambda: mma_step(fastest), packed_bytes),
            ("packed mma o-proj and down-proj, bf16 q|k|v and gate/up", hybrid_step, hybrid_bytes)]  # fmt: skip
    for rnd in range(3):
        for name, run, nbytes in rows:
            us = graph_us(run) / layers_n
            ideal = nbytes / read_gbs / 1e3
            result["chain"].append({"variant": name, "round": rnd, "us": us, "ideal_us": ideal})
            print(f"{name[:100]:100s} {us:6.2f} us a layer (ideal {ideal:5.2f}, {100 * ideal / us:4.1f}%)")
    if json_path:
        json_path.write_text(json.dumps(result, indent=2))
    return 0


def compile_only() -> None:
    """Registers, spills and layout conversions of each kind's first setting, compiled for sm_90a here."""
    from triton.runtime.jit import JITFunction

    from scripts.kernel_report import compile_report

    launches = []
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
    meta = torch.device("meta")

    def fake(n: int, k: int) -> dict:
        i32 = {"dtype": torch.int32, "device": meta}
        return {"lo": torch.empty(n // 16, k // 64, 2, 128, **i32), "codes": torch.empty(n // 16, k // 64, 128, **i32),
                "base": torch.empty(n // 16, 8, **i32), "n": n, "k": k}  # fmt: skip

    def bf16(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.bfloat16, device=meta)

    def fp32(n: int) -> torch.Tensor:
        return torch.empty(n, device=meta)

    for kind, (block_m, split, ahead) in ((kind, cands[0]) for kind, cands in ALONE_SETTINGS.items()):
        common = {"split": split, "block_m": block_m, "ahead": ahead}
        if kind == "qkv":
            mma_split_launch(fake(4096, 2048), fp32(4096), x=fp32(2048), norm=bf16(2048), **common)
        elif kind == "o":
            mma_split_launch(
                fake(2048, 2048), fp32(2048), act=bf16(2048), accumulate=True, zero=fp32(4096), **common
            )
        elif kind == "gate_up":
            mma_split_launch(fake(6144, 2048), bf16(6144), x=fp32(2048), norm=bf16(2048), packed_up=fake(6144, 2048),
                             **common)  # fmt: skip
        else:
            mma_split_launch(fake(2048, 6144), fp32(2048), act=bf16(6144), accumulate=True, **common)
        fn, args, kwargs = launches.pop()
        report = compile_report(fn, args, kwargs, kwargs["num_warps"])
        converts = Path(f"/tmp/kernel_report_{fn.__name__}.ttgir").read_text().count("convert_layout")
        print(
            f"{kind:8s} {(block_m, split, ahead)} regs{report.split('regs')[1].split('{')[0]} converts {converts}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.compile:
        compile_only()
        return 0
    from inference.bench.model_setup import cuda_missing

    if cuda_missing("packed_mma_probe"):
        return 2
    return chain(args.json)


if __name__ == "__main__":
    sys.exit(main())
