"""Whether the 12-bit packed weights of kernels/packed_gemv.py stream faster when the products run on the tensor
cores: a plain matrix-vector product (bf16 input, no norm, no exceptions) whose decoded bf16 pairs go straight into
`mma.sync.m16n8k16` as A fragments, so the fp32 split of each pair and the FFMA per weight are gone.

    python scripts/packed_mma_probe.py [--json out.json]      # GPU: check, then us a call against the bf16 kernel
    python scripts/packed_mma_probe.py --compile              # no GPU: registers and the TTGIR layouts, sm_90a

The layout is the one the kernel's tensors have: a program's [BM, 128] int32 tiles put 4 consecutive words in a
thread and 32 threads along a row (Triton's blocked layout for 16-byte loads), so word c of a row sits in lane
c // 4, slot c % 4. The packer puts in that word the 8 weights of lane c // 4's A fragment for M-tile (row) r and
K-part 4 i + c % 4 of chunk i; an inline asm over the 4 slots of a thread chains the 4 K-parts' mma. B holds the
input in column 0 only (lanes 0-3), so D's column 0 is the product: lanes with c // 4 % 4 == 0 store rows g and
g + 8 of the tile. Exceptions (weights under the 16-binade window, ~1e-4) are decoded to the window's floor here:
the check compares with that matrix, and the timing leaves their correction out.
"""

import argparse
import json
import os
import sys
from pathlib import Path

if "--compile" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from kernels import pdl_kwargs  # noqa: E402

WINDOW = 7
_MMA4 = tl.constexpr(
    "{\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $8, $12, $16}, {$20, $24}, "
    "{$28, $29, $30, $31};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$5, $9, $13, $17}, {$21, $25}, "
    "{$0, $1, $2, $3};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$6, $10, $14, $18}, {$22, $26}, "
    "{$0, $1, $2, $3};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$7, $11, $15, $19}, {$23, $27}, "
    "{$0, $1, $2, $3};\n"
    "}"
)
_PRMT_PAIR_0 = tl.constexpr("prmt.b32 $0, $1, $2, 0x5140;")
_PRMT_PAIR_1 = tl.constexpr("prmt.b32 $0, $1, $2, 0x7362;")


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


def chunk_columns(k: int, device) -> torch.Tensor:
    """[K] long: the weight column at each position of the fragments' order, where position (4 i + j) * 16 + kk
    is column kk of K-part j of chunk i. Column 2t + e + 8h of K-part j (lane t's B pair h, element e) is
    64 i + 32 h + 8 t + 2 j + e, so that a lane's B pairs for its 4 K-parts are 16 contiguous bytes."""
    pos = torch.arange(k, device=device)
    i, j, kk = pos // 64, (pos // 16) % 4, pos % 16
    h, t, e = kk // 8, (kk % 8) // 2, kk % 2
    return 64 * i + 32 * h + 8 * t + 2 * j + e


def pack_mma(weight: torch.Tensor) -> dict:
    """weight [N, K] bf16 (N % 16 == 0, K % 64 == 0) -> lo [N/16, K/64, 2, 128], codes [N/16, K/64, 128] and base
    [N/16, 8] int32, and the matrix they decode to (exceptions at their row's floor)."""
    n, k = weight.shape
    original = weight.view(torch.int16).to(torch.int32) & 0xFFFF
    weight = weight[:, chunk_columns(k, weight.device)].contiguous()
    bits = weight.view(torch.int16).to(torch.int32) & 0xFFFF
    low, top, sign = bits & 0xFF, (bits >> 8) & 0x7F, bits >> 15
    base = top.amax(dim=1).clamp(min=WINDOW)
    depth = base[:, None] - top
    exception = depth > WINDOW
    code = torch.where(exception, WINDOW, sign * 8 + depth)
    low = torch.where(exception, 0, low)
    top0 = (original >> 8) & 0x7F  # the decoded matrix in the weight's own column order
    decoded = torch.where(base[:, None] - top0 > WINDOW, (base[:, None] - WINDOW) << 8, original)
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

    def as_i32(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32).contiguous()

    b = base.view(m_tiles, 2, 8)  # rows g and g + 8 of each tile
    base_words = b[:, 0] * 0x0101 + b[:, 1] * 0x01010000
    return {"lo": as_i32(lo), "codes": as_i32(words), "base": as_i32(base_words.to(torch.int64)),
            "decoded": decoded.to(torch.int16).view(torch.bfloat16), "n": n, "k": k}  # fmt: skip


@triton.jit
def _pair(lo, hi, PAIR: tl.constexpr):
    if PAIR == 0:
        return tl.inline_asm_elementwise(
            _PRMT_PAIR_0, "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
        )
    return tl.inline_asm_elementwise(_PRMT_PAIR_1, "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _mma_gemv_kernel(act_ptr, lo_ptr, code_ptr, base_ptr, out_ptr, K: tl.constexpr, BM: tl.constexpr,
                     AHEAD: tl.constexpr, SPLIT: tl.constexpr, ACCUMULATE: tl.constexpr,
                     USE_PDL: tl.constexpr):  # fmt: skip
    CHUNKS: tl.constexpr = K // 64 // SPLIT  # this program's share of K, from chunk k0 on
    k0 = tl.program_id(1) * CHUNKS
    m = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM] M-tiles (16 rows each)
    c = tl.arange(0, 128)
    lane = c // 4
    g = lane // 4
    t = lane % 4
    j = c % 4
    tile = (m[:, None] * (K // 64) + k0) * 256 + c[None, :]  # [BM, 128] word offsets of chunk k0's lo words
    code_tile = (m[:, None] * (K // 64) + k0) * 128 + c[None, :]
    base = tl.load(base_ptr + m[:, None] * 8 + g[None, :])  # [BM, 128]: rows g, g + 8 in bytes 0-1, 2-3
    if USE_PDL:
        gdc_launch_dependents()
    # AHEAD chunks' words in flight before the wait (the weights do not depend on the previous kernel)
    ring = ()
    for i in tl.static_range(AHEAD):
        ring = ring + ((tl.load(lo_ptr + tile + i * 256, eviction_policy="evict_first"),
                        tl.load(lo_ptr + tile + i * 256 + 128, eviction_policy="evict_first"),
                        tl.load(code_ptr + code_tile + i * 128, eviction_policy="evict_first")),)  # fmt: skip
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros([BM, 128], dtype=tl.float32) + (base * 0).to(tl.float32)  # the tiles' layout
    for i in tl.static_range(CHUNKS):
        lo0, lo1, codes = ring[0]
        if i + AHEAD < CHUNKS:
            nxt = i + AHEAD
            ring = ring[1:] + ((tl.load(lo_ptr + tile + nxt * 256, eviction_policy="evict_first"),
                                tl.load(lo_ptr + tile + nxt * 256 + 128, eviction_policy="evict_first"),
                                tl.load(code_ptr + code_tile + nxt * 128, eviction_policy="evict_first")),)  # fmt: skip
        else:
            ring = ring[1:]
        # B: the input's bf16 pairs at columns 2t, 2t + 1 (and + 8) of K-part 4 i + j, in lanes of column 0 only
        # (loaded [BM, 128] in the tiles' layout, a thread's 4 slots 16 contiguous bytes: see chunk_columns)
        pair = ((k0 + i) * 32 + 4 * t + j)[None, :] + (m * 0)[:, None]  # [BM, 128] bf16-pair index
        column_0 = (g == 0)[None, :] & (m >= 0)[:, None]
        b0 = tl.load(act_ptr + pair, mask=column_0, other=0)
        b1 = tl.load(act_ptr + pair + 16, mask=column_0, other=0)
        c0 = codes & 0x0F0F0F0F
        c1 = (codes >> 4) & 0x0F0F0F0F
        h0 = (c0 & 0x08080808) * 17 + (base - c0)
        h1 = (c1 & 0x08080808) * 17 + (base - c1)
        acc = tl.inline_asm_elementwise(
            _MMA4, "=&f,=&f,=&f,=&f," + "r," * 24 + "f,f,f,f",  # early clobber: later mma read inputs
            [_pair(lo0, h0, 0), _pair(lo0, h0, 1), _pair(lo1, h1, 0), _pair(lo1, h1, 1), b0, b1, acc],
            dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip
    rows = m[:, None] * 16 + g[None, :] + 8 * (j[None, :] // 2)
    keep = ((t == 0) & (j % 2 == 0))[None, :] & (rows >= 0)
    if SPLIT > 1:  # the programs of a row block add their parts of K into the residual
        tl.atomic_add(out_ptr + rows, acc, mask=keep, sem="relaxed")
    else:
        if ACCUMULATE:
            acc += tl.load(out_ptr + rows, mask=keep, other=0.0)
        tl.store(out_ptr + rows, acc, mask=keep)


def mma_gemv(act: torch.Tensor, packed: dict, out: torch.Tensor, block_m: int = 4, ahead: int = 4,
             accumulate: bool = False, use_pdl: bool = False, num_warps: int = 4, split: int = 1) -> torch.Tensor:  # fmt: skip
    """out [N] fp32 (+)= W @ act for act [K] bf16; split: programs sharing a row block's K (atomic adds, so
    accumulate only)."""
    n, k = packed["n"], packed["k"]
    if split > 1 and not accumulate or (k // 64) % split:
        raise ValueError(f"split {split}: needs accumulate and K / 64 = {k // 64} a multiple of it")
    grid = (triton.cdiv(n // 16, block_m), split)
    _mma_gemv_kernel[grid](act.view(torch.int32), packed["lo"], packed["codes"], packed["base"], out, K=k,
                           BM=block_m, AHEAD=min(ahead, k // 64 // split), SPLIT=split, ACCUMULATE=accumulate,
                           USE_PDL=use_pdl,
                           num_warps=num_warps, **pdl_kwargs(use_pdl))  # fmt: skip
    return out


SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up (one matrix)": (12288, 2048), "down": (2048, 6144)}
# (block_m, ahead, warps, split): block_m >= warps, so that each thread holds 4 consecutive words of a row
SETTINGS = (
    (4, 8, 4, 1),
    (4, 12, 4, 1),
    (8, 8, 8, 1),
    (2, 8, 2, 1),
    (1, 8, 1, 1),
    (4, 8, 4, 2),
    (4, 8, 4, 4),
    (2, 8, 2, 4),
    (4, 8, 4, 8),
    (2, 8, 2, 8),
    (1, 8, 1, 8),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.compile:
        from triton.runtime.jit import JITFunction

        from scripts.kernel_report import compile_report

        launches = []
        JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
        meta = torch.device("meta")
        for block_m, ahead, warps, _ in SETTINGS[:1]:
            n, k = SHAPES["down"]
            packed = {"lo": torch.empty(n // 16, k // 64, 2, 128, dtype=torch.int32, device=meta),
                      "codes": torch.empty(n // 16, k // 64, 128, dtype=torch.int32, device=meta),
                      "base": torch.empty(n // 16, 8, dtype=torch.int32, device=meta), "n": n, "k": k}  # fmt: skip
            mma_gemv(torch.empty(k, dtype=torch.bfloat16, device=meta), packed, torch.empty(n, device=meta), block_m,
                     ahead, accumulate=True, use_pdl=True, num_warps=warps)  # fmt: skip
            fn, a, kw = launches.pop()
            print((block_m, ahead, warps), compile_report(fn, a, kw, warps))
        ttgir = Path("/tmp/kernel_report__mma_gemv_kernel.ttgir").read_text()
        print("\n".join(line for line in ttgir.splitlines() if line.startswith("#blocked")))
        return 0

    from inference.bench.ceiling import measure_bandwidth
    from inference.bench.model_setup import cuda_missing
    from kernels.lane_reduce_gemv import lane_reduce_gemv
    from scripts.packed_gemv_probe import graph_us

    if cuda_missing("packed_mma_probe"):
        return 2
    device = torch.device("cuda")
    read_gbs = measure_bandwidth(device)["read_gbs"]
    gen = torch.Generator(device).manual_seed(0)
    result = {"read_gbs": read_gbs, "rows": []}
    print(
        f"read {read_gbs:,.0f} GB/s; us a call, 28 matrices in a graph, each launch waiting on the one before"
    )
    for name, (n, k) in SHAPES.items():
        weights = [
            (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(torch.bfloat16) for _ in range(28)
        ]
        packs = [pack_mma(w) for w in weights]
        act = torch.randn(k, device=device, generator=gen).to(torch.bfloat16)
        out = torch.zeros(n, device=device)
        mma_gemv(act, packs[0], out)
        ref = packs[0]["decoded"].float() @ act.float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        out.zero_()
        mma_gemv(act, packs[0], out, accumulate=True, split=2)
        err = max(err, ((out - ref).abs().max() / ref.abs().max()).item())
        packed_bytes = sum(packs[0][key].numel() * 4 for key in ("lo", "codes", "base"))
        x = torch.zeros(1, n, device=device)
        bf16_us = (
            graph_us(lambda: [lane_reduce_gemv(act[None], w[None], x, use_pdl=True) for w in weights]) / 28
        )
        line = f"{name:22s} [{n} x {k}] max rel err {err:.1e}; bf16 lane_reduce_gemv {bf16_us:6.2f} " \
               f"({100 * n * k * 2 / bf16_us / 1e3 / read_gbs:4.1f}%)"  # fmt: skip
        row = {"kind": name, "err": err, "bf16_us": bf16_us, "packed": []}
        for block_m, ahead, warps, split in SETTINGS:
            if (n // 16) % block_m or (k // 64) % split:
                continue
            try:
                us = graph_us(lambda: [mma_gemv(act, p, out, block_m, ahead, accumulate=True, use_pdl=True,
                                                num_warps=warps, split=split) for p in packs]) / 28  # fmt: skip
            except Exception as error:  # a setting that does not build is reported, not fatal
                line += f"\n    {(block_m, ahead, warps, split)} failed: {str(error)[:80]}"
                continue
            row["packed"].append({"settings": [block_m, ahead, warps], "us": us})
            line += (
                f"  {(block_m, ahead, warps)} {us:6.2f} ({100 * packed_bytes / us / 1e3 / read_gbs:4.1f}%)"
            )
        result["rows"].append(row)
        print(line)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
