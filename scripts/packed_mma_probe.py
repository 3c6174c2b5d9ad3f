"""The 12-bit packed weights of kernels/packed_gemv.py with the products on the tensor cores: each thread's
decoded bf16 pairs go straight into `mma.sync.m16n8k16` as A fragments, so the fp32 split of each pair and the
FFMA per weight are gone (~2.3 instructions a weight where kernels/packed_gemv.py needs ~8). A decode layer of
qwen3-1.7b's shapes (q|k|v, o-proj, gate/up, down-proj; attention left out, a fixed bf16 vector in its place), 28
layers in one CUDA graph: first one layer checked against the runner's bf16 kernels, then each kind alone in a
few settings, then the chain all packed, half packed (o-proj and down-proj) and all bf16, in turns.

    python scripts/packed_mma_probe.py [--json out.json]     # GPU
    python scripts/packed_mma_probe.py --compile             # no GPU: registers and layout conversions, sm_90a

Layout. A program's [BM, 128] int32 tiles put 4 consecutive words in a thread and 32 threads along a row
(Triton's blocked layout for 16-byte loads; the kernel keeps every operand of the asm in it), so word c of row r
sits in lane c // 4, slot c % 4 of warp r. pack_mma puts in that word (two words of low bytes, one of codes) the 8
weights of lane c // 4's A fragment for M-tile r (16 rows) and K-part 4 i + c % 4 of chunk i (64 columns); one
inline asm over a thread's 4 slots chains their 4 mma. B holds the input in column 0 only (lanes 0-3), so D's
column 0 is the product: lanes with c // 4 % 4 == 0 hold rows g and g + 8 of the tile in slots 0 and 2. A
kernel takes 1 / SPLIT of K and adds into an fp32 output with atomics when SPLIT > 1. A normed kind builds B from
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

from kernels.packed_gemv import as_int32_words, bf16_pair, encode_rows, high_bytes, row_floors  # noqa: E402


def mma_chain(parts: int) -> str:
    """The asm of 4 chained `mma.sync.m16n8k16` over a thread's 4 slots (K-parts), each against `parts` B
    operands (2: x * g's bf16 hi and lo parts). Operands: D $0-$3; A's 4 registers, 4 slots each, $4-$19; then
    per part B's 2 registers, 4 slots each; then C's 4. Outputs are early-clobber in the constraints, since the
    later mma read inputs after D is written."""
    lines = []
    for j in range(4):
        for part in range(parts):
            a = ", ".join(f"${4 + 4 * r + j}" for r in range(4))
            b = f"${20 + 8 * part + j}, ${24 + 8 * part + j}"
            c_in = 20 + 8 * parts
            c = (
                f"${c_in}, ${c_in + 1}, ${c_in + 2}, ${c_in + 3}"
                if j == 0 and part == 0
                else "$0, $1, $2, $3"
            )
            lines.append(
                f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{{a}}}, {{{b}}}, {{{c}}};"
            )
    return "{\n" + "\n".join(lines) + "\n}"


_MMA4 = tl.constexpr(mma_chain(1))
_MMA4_SPLIT_B = tl.constexpr(mma_chain(2))


def fragment_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) within a 16 x 16 tile of the weight in lane l's A fragment, byte b of word a: [2, 4, 32] each.
    Word 0 holds a0, a1 (rows g, g + 8 at columns 2t, 2t + 1), word 1 a2, a3 (columns + 8)."""
    lane = torch.arange(32, device=device)
    g, t = lane // 4, lane % 4
    rows = torch.empty(2, 4, 32, dtype=torch.long, device=device)
    cols = torch.empty_like(rows)
    for a in range(2):
        for b in range(4):
            rows[a, b] = g + 8 * (b // 2)
            cols[a, b] = 2 * t + (b % 2) + 8 * a
    return rows, cols


def chunk_columns(k: int, device, normed: bool = False) -> torch.Tensor:
    """[K] long: the weight column at each position of the fragments' order, where position (4 i + j) * 16 + kk
    is column kk of K-part j of chunk i. Column 2t + e + 8h of K-part j (lane t's B pair h, element e) is
    64 i + 32 h + 8 t + 2 j + e, so that a lane's B pairs for its 4 K-parts are 16 contiguous bytes of a bf16
    input; for a normed input, whose pairs the kernel builds from fp32 x * g, 64 i + 32 h + 8 t + 4 e + j, so
    that each element's x and g for the 4 K-parts are contiguous."""
    pos = torch.arange(k, device=device)
    i, j, kk = pos // 64, (pos // 16) % 4, pos % 16
    h, t, e = kk // 8, (kk % 8) // 2, kk % 2
    return 64 * i + 32 * h + 8 * t + (4 * e + j if normed else 2 * j + e)


def pack_mma(weight: torch.Tensor, normed: bool = False) -> dict:
    """weight [N, K] bf16 (N % 16 == 0, K % 64 == 0) -> lo [N/16, K/64, 2, 128], codes [N/16, K/64, 128] and base
    [N/16, 8] int32, and the matrix they decode to (exceptions at their row's floor)."""
    n, k = weight.shape
    bits, low, code, base, exception = encode_rows(weight)
    decoded = torch.where(exception, row_floors(base)[:, None], bits)
    order = chunk_columns(k, weight.device, normed)  # the encoding is per weight: the columns move with it
    low, code = low[:, order], code[:, order]
    rows, cols = fragment_index(weight.device)
    m_tiles, chunks = n // 16, k // 64
    low4 = low.view(m_tiles, 16, k // 16, 16)  # [m, row, kp, col]
    code4 = code.view(m_tiles, 16, k // 16, 16)
    lo = torch.zeros(m_tiles, k // 16, 2, 32, dtype=torch.int64, device=weight.device)  # [m, kp, a, lane]
    words = torch.zeros(m_tiles, k // 16, 32, dtype=torch.int64, device=weight.device)
    for a in range(2):
        for b in range(4):
            part = low4[:, rows[a, b], :, cols[a, b]]  # [32, m, kp]
            lo[:, :, a] |= part.permute(1, 2, 0).to(torch.int64) << (8 * b)
            nib = code4[:, rows[a, b], :, cols[a, b]].permute(1, 2, 0).to(torch.int64)
            words |= nib << (4 * (2 * b + a))
    # [m, kp = 4 i + j, a, lane] -> [m, i, a, c = 4 lane + j]
    lo = lo.view(m_tiles, chunks, 4, 2, 32).permute(0, 1, 3, 4, 2).reshape(m_tiles, chunks, 2, 128)
    words = words.view(m_tiles, chunks, 4, 32).permute(0, 1, 3, 2).reshape(m_tiles, chunks, 128)
    b = base.view(m_tiles, 2, 8)  # rows g and g + 8 of each tile
    base_words = b[:, 0] * 0x0101 + b[:, 1] * 0x01010000
    return {"lo": as_int32_words(lo), "codes": as_int32_words(words), "base": as_int32_words(base_words.to(torch.int64)),
            "decoded": decoded.to(torch.int16).view(torch.bfloat16), "n": n, "k": k}  # fmt: skip


@triton.jit
def _chunk_loads(lo_ptr, code_ptr, tile, code_tile, i: tl.constexpr):
    return (tl.load(lo_ptr + tile + i * 256, eviction_policy="evict_first"),
            tl.load(lo_ptr + tile + i * 256 + 128, eviction_policy="evict_first"),
            tl.load(code_ptr + code_tile + i * 128, eviction_policy="evict_first"))  # fmt: skip


@triton.jit
def _mma_chunk(words, base, bh0, bh1, bl0, bl1, acc, SPLIT_B: tl.constexpr):
    """acc after chunk `words` (lo0, lo1, codes: 4 K-parts a thread) against B (hi and, with SPLIT_B, lo)."""
    lo0, lo1, codes = words
    h0 = high_bytes(codes, base, 0)
    h1 = high_bytes(codes, base, 1)
    a = [bf16_pair(lo0, h0, 0, True), bf16_pair(lo0, h0, 1, True), bf16_pair(lo1, h1, 0, True),
         bf16_pair(lo1, h1, 1, True)]  # fmt: skip
    if SPLIT_B:
        return tl.inline_asm_elementwise(_MMA4_SPLIT_B, "=&f,=&f,=&f,=&f," + "r," * 32 + "f,f,f,f",
                                         a + [bh0, bh1, bl0, bl1, acc], dtype=tl.float32, is_pure=True,
                                         pack=4)  # fmt: skip
    return tl.inline_asm_elementwise(_MMA4, "=&f,=&f,=&f,=&f," + "r," * 24 + "f,f,f,f", a + [bh0, bh1, acc],
                                     dtype=tl.float32, is_pure=True, pack=4)  # fmt: skip


@triton.jit
def _bf16_bits(v):
    return v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


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
    first_hi = _bf16_bits(first)
    second_hi = _bf16_bits(second)
    first_lo = _bf16_bits(first - (first_hi << 16).to(tl.float32, bitcast=True))
    second_lo = _bf16_bits(second - (second_hi << 16).to(tl.float32, bitcast=True))
    return first_hi | (second_hi << 16), first_lo | (second_lo << 16)


@triton.jit
def _mma_split_kernel(act_ptr, x_ptr, norm_ptr, lo_ptr, code_ptr, base_ptr, lo_u_ptr, code_u_ptr, base_u_ptr,
                      out_ptr, zero_ptr, eps, K: tl.constexpr, BM: tl.constexpr, AHEAD: tl.constexpr,
                      SPLIT: tl.constexpr, NORMED: tl.constexpr, GATED: tl.constexpr, ACCUMULATE: tl.constexpr,
                      ZERO: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER_EARLY: tl.constexpr):  # fmt: skip
    """BM M-tiles a program (a warp each), 1 / SPLIT of K; SPLIT > 1 adds into an fp32 out with atomics. NORMED:
    B is x * g in a bf16 hi and lo part, computed here from the fp32 x, and rstd scales the sums. ZERO: each
    program also clears its ZERO floats of zero_ptr (a buffer the next launches add into)."""
    CHUNKS: tl.constexpr = K // 64 // SPLIT
    k0 = tl.program_id(1) * CHUNKS
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.arange(0, 128)
    lane = c // 4
    g = lane // 4
    t = lane % 4
    j = c % 4
    tile = (m[:, None] * (K // 64) + k0) * 256 + c[None, :]
    code_tile = (m[:, None] * (K // 64) + k0) * 128 + c[None, :]
    base = tl.load(base_ptr + m[:, None] * 8 + g[None, :])
    base_u = base
    if GATED:
        base_u = tl.load(base_u_ptr + m[:, None] * 8 + g[None, :])
    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    ring = ()
    ring_u = ()
    for i in tl.static_range(AHEAD):
        ring = ring + (_chunk_loads(lo_ptr, code_ptr, tile, code_tile, i),)
        if GATED:
            ring_u = ring_u + (_chunk_loads(lo_u_ptr, code_u_ptr, tile, code_tile, i),)
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
            ring = ring + (_chunk_loads(lo_ptr, code_ptr, tile, code_tile, i + AHEAD),)
        if GATED:
            words_u = ring_u[0]
            ring_u = ring_u[1:]
            if i + AHEAD < CHUNKS:
                ring_u = ring_u + (_chunk_loads(lo_u_ptr, code_u_ptr, tile, code_tile, i + AHEAD),)
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
        packed = {k: pack_mma(w, normed=k in ("qkv", "gate_up", "up")) for k, w in raw.items()}
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
