"""out += W @ act on the tensor cores, W a bf16 matrix held losslessly in 12 bits a weight: the o-proj and the
down-proj of one-lane models (Llama, Qwen2, Qwen3), added into the fp32 residual, and their gate/up, added into
fp32 sums that the down-proj reads through the SiLU.

    out[n] += sum_k W[n, k] * act[k]        W: [N, K] (N % 16 == 0, K % 64 == 0); act: [K] bf16 (or fp32); out fp32

The encoding is kernels/packed_format.py's (the low byte kept, the sign and top exponent bits as a 4-bit depth
under the row's largest, weights further down kept exactly in a list beside the matrix). What this kernel adds is
where the decoded weights go: a decoded pair of bf16 numbers is exactly what `mma.sync.m16n8k16` takes in an A
register, so the decode feeds the tensor cores with no fp32 widening and no FFMA a weight (~2.3 instructions a
weight, where a decode into FFMAs on the CUDA cores needs ~8 and streams no faster than bf16).

Layout (pack_mma). A program holds [BM, 128] int32 tiles, 4 consecutive words a thread and 32 threads along a
row (Triton's blocked layout for 16-byte loads), so word c of row r lies in lane c // 4, slot c % 4 of warp r.
Row r is an M-tile (16 rows of W), a chunk is 64 columns (4 K-parts of 16), and word c of a chunk holds lane
c // 4's A fragment for K-part c % 4: two words of low bytes (lo) and one of codes, per M-tile and chunk
[2, 128] + [128] words. A thread's 4 slots are its 4 K-parts: one inline asm chains their 4 mma. The columns
within a chunk are permuted (chunk_columns) so that a lane's B pairs for its 4 K-parts are 16 contiguous bytes
of act. B holds act in column 0 only (lanes 0-3 load it, the others hold zeros), so D's column 0 is the product:
lanes 0, 4, ..., 28 hold rows g and g + 8 of the tile (g = lane // 4) in their slots 0 and 2. An input built in
two bf16 parts (an fp32 act, NORMED, GLU_FP32: a hi and a lo part) puts the lo parts in B's column 1 (lanes 4-7),
so one mma a K-part takes both and D's columns 0 and 1 (slots 0 + 1, 2 + 3) are summed at the end.

A program takes BM M-tiles and 1 / SPLIT of K and adds its sums into out with atomics (the residual already
holds x; the order of the splits' adds is the only difference from one sum). The exceptions of its M-tiles (true
weight times act at its column, less the floor each decodes to times the same) are shared out over the SPLIT
programs of those tiles and added the same way. The next kernel reads out after its griddepcontrol wait, which
waits for this grid's completion and its memory (atomics included). In the decode step 4 chunks a program ran
fastest (pick_split), with the blocks of inference/fast/settings.py.

The gate/up (NORMED) builds B from the residual x times the norm weight g (a bf16 hi and lo part) and leaves
RMSNorm's scalar rstd out of its sums: one program writes it, and the down-proj (GLU) builds its B as
silu(rstd * gate) * (rstd * up) from the sums. A built B is made one pair a lane and gathered into the slots
(chunk_input_pairs): built in the slots themselves, its SiLU took more instructions than the weights' decode.

A Laneformer's gate/up (packed_glu_gemv, FUSED_GLU) runs every lane's in one launch over pack_glu's rows: a
program takes M-tiles of one lane (LANE_TILES a lane) over all of K, reads that lane's rows of x and g, computes
its rstd, and since rows g and g + 8 of an M-tile are a gate row and its up row, it holds both sums of its rows
and stores h = silu(rstd * gate) * (rstd * up) itself, its exceptions added first: no atomics.

Under Triton's interpreter (no inline asm) the kernel decodes the same words the same way and sums each
lane's products in fp32 in the mma's place (rows g and g + 8 of each tile): the tests check the layout, the
decode, the splits and the exceptions on the CPU, and the mma itself on the GPU.

Bytes: 1.5 a weight, 32 a M-tile of bases, 12 an exception (~1e-4 of a random matrix's weights).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs
from kernels.lane_reduce_gemv import check_lanes
from kernels.packed_format import (
    as_int32_words,
    bf16_pair,
    encode_rows,
    floor_value,
    high_bytes,
    high_half,
    low_half,
    row_floors,
)

CHUNK = 64  # columns a chunk: 4 K-parts of mma.sync.m16n8k16
EXC_BLOCK = 16  # exceptions a program adds at a time
# What B is built from (the kernel's ACT): a bf16 act; an fp32 act; the fp32 residual x times an RMSNorm weight g
# (NORMED: the gate/up; the sums are W @ (x * g), the norm's scalar rstd is left to the reader of the sums, and
# one program writes it); the fp32 sums [2K] of a NORMED launch (GLU: B = silu(rstd * gate) * (rstd * up) rounded
# to bf16, the down-proj after a packed gate/up of a bf16 model; GLU_FP32 the same unrounded, an fp32 model's)
BF16, FP32, NORMED, GLU, GLU_FP32 = (tl.constexpr(kind) for kind in range(5))
# A Laneformer o-proj's or down-proj's reduction (kernels/lane_reduce_gemv.py's modes but SUM, which needs every
# lane's partial of the layer): none (out += the sums), DELAYED or SCALED
NO_REDUCE, DELAYED, SCALED = (tl.constexpr(kind) for kind in range(3))


def mma_chain() -> str:
    """The asm of 4 chained `mma.sync.m16n8k16` over a thread's 4 slots (K-parts). Operands: D $0-$3; A's 4
    registers, 4 slots each, $4-$19; B's 2 registers, 4 slots each, $20-$27; C's 4, $28-$31. The outputs are
    early-clobber in the constraints, since the later mma read inputs after D is written."""
    lines = []
    for j in range(4):
        a = ", ".join(f"${4 + 4 * r + j}" for r in range(4))
        c = "$28, $29, $30, $31" if j == 0 else "$0, $1, $2, $3"
        lines.append(
            f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{{a}}}, {{${20 + j}, ${24 + j}}}, {{{c}}};"
        )
    return "{\n" + "\n".join(lines) + "\n}"


MMA4 = tl.constexpr(mma_chain())


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
    64 i + 32 h + 8 t + 2 j + e, so that a lane's B pairs for its 4 K-parts are 16 contiguous bytes of a bf16
    input."""
    pos = torch.arange(k, device=device)
    i, j, kk = pos // 64, (pos // 16) % 4, pos % 16
    h, t, e = kk // 8, (kk % 8) // 2, kk % 2
    return 64 * i + 32 * h + 8 * t + 2 * j + e


@dataclass
class MmaPackedWeight:
    """A [N, K] bf16 matrix in pack_mma's layout (the module docstring)."""

    lo: torch.Tensor  # [N / 16, K / 64, 2, 128] int32: per M-tile and chunk, the two words of low bytes
    codes: torch.Tensor  # [N / 16, K / 64, 128] int32: the 8 codes of each lane's fragment words
    base: torch.Tensor  # [N / 16, 8] int32: rows g (bytes 0-1) and g + 8 (bytes 2-3): their top exponent bits
    exc_start: torch.Tensor  # [N / 16 + 1] int32: M-tile m's exceptions: entries exc_start[m] .. [m + 1] - 1
    exc_row: torch.Tensor  # [max(E, 1)] int32: the row of each
    exc_col: torch.Tensor  # [max(E, 1)] int32: its column (of W, not of the permuted order)
    exc_value: torch.Tensor  # [max(E, 1)] fp32: its true weight (it decodes to its row's floor)
    tile_exceptions: list[int]  # each M-tile's count, on the host: the launches' rounds over them (below)
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def exceptions(self) -> int:
        return int(self.exc_start[-1])

    def exception_rounds(self, block_m: int, split: int) -> int:
        """Blocks of EXC_BLOCK exceptions the most loaded program adds, with block_m M-tiles a program and their
        exceptions shared over `split` programs (a constant of the kernel: a loop over loaded bounds has no
        interpreter form here, and a fixed count of masked blocks costs nothing where there are none)."""
        counts = self.tile_exceptions
        groups = [sum(counts[m : m + block_m]) for m in range(0, len(counts), block_m)]
        return triton.cdiv(triton.cdiv(max(groups, default=0), split), EXC_BLOCK)

    def nbytes(self) -> int:
        """What a product reads: the words, the bases and the exception lists."""
        tensors = (self.lo, self.codes, self.base, self.exc_start, self.exc_row, self.exc_col, self.exc_value)
        return sum(t.numel() * t.element_size() for t in tensors)


def fits(n: int, k: int) -> bool:
    """Whether a [N, K] matrix has pack_mma's shape: whole M-tiles and chunks."""
    return n > 0 and k > 0 and n % 16 == 0 and k % CHUNK == 0


def pack_mma(weight: torch.Tensor) -> MmaPackedWeight:
    """weight [N, K] bf16 (fits) -> its MmaPackedWeight on the same device; unpack_mma gives every bit back."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"weight: expected a [N, K] bf16 matrix, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if not fits(n, k):
        raise ValueError(f"weight: [{n}, {k}] is not whole 16-row tiles by 64-column chunks")
    device = weight.device
    bits, low, code, base, exception = encode_rows(weight)
    order = chunk_columns(k, device)  # the encoding is per weight: the columns move with it
    low, code = low[:, order], code[:, order]
    rows, cols = fragment_index(device)
    m_tiles, chunks = n // 16, k // CHUNK
    low4 = low.view(m_tiles, 16, k // 16, 16)  # [m, row, kp, col]
    code4 = code.view(m_tiles, 16, k // 16, 16)
    lo = torch.zeros(m_tiles, k // 16, 2, 32, dtype=torch.int64, device=device)  # [m, kp, a, lane]
    words = torch.zeros(m_tiles, k // 16, 32, dtype=torch.int64, device=device)
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

    # The exceptions whose true weight is not the floor they decode to, row-major (so grouped by M-tile).
    floors = row_floors(base)
    keep = exception & (bits != floors[:, None])
    exc_rows, exc_cols = keep.nonzero(as_tuple=True)
    per_tile = torch.bincount(exc_rows // 16, minlength=m_tiles)
    exc_start = torch.zeros(m_tiles + 1, dtype=torch.int32, device=device)
    exc_start[1:] = per_tile.cumsum(0)

    def at_least_one(t: torch.Tensor) -> torch.Tensor:  # a kernel argument needs an allocation
        return t.contiguous() if t.numel() else torch.zeros(1, dtype=t.dtype, device=device)

    return MmaPackedWeight(
        lo=as_int32_words(lo), codes=as_int32_words(words), base=as_int32_words(base_words.to(torch.int64)),
        exc_start=exc_start, exc_row=at_least_one(exc_rows.to(torch.int32)),
        exc_col=at_least_one(exc_cols.to(torch.int32)), exc_value=at_least_one(weight[exc_rows, exc_cols].float()),
        tile_exceptions=per_tile.tolist(), n=n, k=k,
    )  # fmt: skip


def unpack_mma(packed: MmaPackedWeight) -> torch.Tensor:
    """The bf16 [N, K] matrix a MmaPackedWeight holds (torch only: the layout's reference for the tests)."""
    n, k, device = packed.n, packed.k, packed.lo.device
    m_tiles, chunks = n // 16, k // CHUNK
    rows, cols = fragment_index(device)
    # [m, i, a, c = 4 lane + j] -> [m, kp = 4 i + j, a, lane]
    lo = (packed.lo.to(torch.int64) & 0xFFFFFFFF).view(m_tiles, chunks, 2, 32, 4).permute(0, 1, 4, 2, 3)
    lo = lo.reshape(m_tiles, k // 16, 2, 32)
    words = (packed.codes.to(torch.int64) & 0xFFFFFFFF).view(m_tiles, chunks, 32, 4).permute(0, 1, 3, 2)
    words = words.reshape(m_tiles, k // 16, 32)
    base_words = packed.base.to(torch.int64) & 0xFFFFFFFF  # [m, g]
    out = torch.zeros(m_tiles, 16, k // 16, 16, dtype=torch.int64, device=device)  # [m, row, kp, col]
    for a in range(2):
        for b in range(4):
            low = (lo[:, :, a] >> (8 * b)) & 0xFF  # [m, kp, lane]
            code = (words >> (4 * (2 * b + a))) & 0xF
            row_base = ((base_words >> (8 * b)) & 0x7F)[:, None, rows[a, b] % 8]  # [m, 1, lane]
            top = (code >> 3) << 7 | (row_base - (code & 7))
            out[:, rows[a, b], :, cols[a, b]] = (top << 8 | low).permute(2, 0, 1)
    permuted = out.view(n, k)
    bits = torch.empty_like(permuted)
    bits[:, chunk_columns(k, device)] = permuted
    weight = bits.to(torch.int16).view(torch.bfloat16).float()
    count = packed.exceptions
    exc_rows, exc_cols = packed.exc_row[:count].long(), packed.exc_col[:count].long()
    weight[exc_rows, exc_cols] = packed.exc_value[:count]
    return weight.to(torch.bfloat16)


def placeholder(n: int, k: int, device) -> MmaPackedWeight:
    """A MmaPackedWeight of the right shapes and no contents, no exceptions: a runner built on the meta device
    (its shapes without its weights) holds these."""
    m_tiles, chunks = n // 16, k // CHUNK

    def empty(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    return MmaPackedWeight(lo=empty(m_tiles, chunks, 2, 128), codes=empty(m_tiles, chunks, 128),
                           base=empty(m_tiles, 8), exc_start=empty(m_tiles + 1), exc_row=empty(1), exc_col=empty(1),
                           exc_value=empty(1, dtype=torch.float32), tile_exceptions=[0] * m_tiles, n=n,
                           k=k)  # fmt: skip


def move(packed: MmaPackedWeight, device) -> MmaPackedWeight:
    """The same MmaPackedWeight with its tensors on `device`."""
    tensors = ("lo", "codes", "base", "exc_start", "exc_row", "exc_col", "exc_value")
    return MmaPackedWeight(**{name: getattr(packed, name).to(device) for name in tensors},
                           tile_exceptions=packed.tile_exceptions, n=packed.n, k=packed.k)  # fmt: skip


@triton.jit
def chunk_loads(lo_ptr, code_ptr, tile, code_tile, i: tl.constexpr):
    """Chunk i's words of a program's tiles (lo word 0, lo word 1, codes; [BM, 128] int32 each). Read once a
    token: evicted first."""
    return (tl.load(lo_ptr + tile + i * 256, eviction_policy="evict_first"),
            tl.load(lo_ptr + tile + i * 256 + 128, eviction_policy="evict_first"),
            tl.load(code_ptr + code_tile + i * 128, eviction_policy="evict_first"))  # fmt: skip


@triton.jit
def program_tiles(K: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr):
    """A program's place in the layout: its first chunk k0, its M-tiles m [BM], each word's lane group g, lane in
    the group t and K-part j ([128]: word c is lane c // 4's K-part c % 4, g = c // 16, t = c // 4 % 4), and the
    offsets of its first chunk's lo words (tile) and code words (code_tile), [BM, 128]."""
    k0 = tl.program_id(1) * (K // 64 // SPLIT)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.arange(0, 128)
    lane = c // 4
    tile = (m[:, None] * (K // 64) + k0) * 256 + c[None, :]
    code_tile = (m[:, None] * (K // 64) + k0) * 128 + c[None, :]
    return k0, m, lane // 4, lane % 4, c % 4, tile, code_tile


@triton.jit
def fragments(words, base, USE_ASM: tl.constexpr):
    """A chunk's words -> the A registers a0-a3 of each slot (bf16 pairs in int32): rows g and g + 8 at
    columns 2t, 2t + 1 (a0, a1), then 8 columns on (a2, a3)."""
    lo0, lo1, codes = words
    h0 = high_bytes(codes, base, 0)
    h1 = high_bytes(codes, base, 1)
    return (bf16_pair(lo0, h0, 0, USE_ASM), bf16_pair(lo0, h0, 1, USE_ASM), bf16_pair(lo1, h1, 0, USE_ASM),
            bf16_pair(lo1, h1, 1, USE_ASM))  # fmt: skip


@triton.jit
def bf16_bits(v):
    """fp32 -> its bf16 (round to nearest even) as the low 16 bits of an int32."""
    return v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def bf16_rounded(v):
    """fp32 -> its nearest bf16 (ties to even), as fp32, by integer arithmetic: the same bits under the
    interpreter, whose bf16 conversion is not the GPU's (finite v)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def split_pair(word):
    """An fp32 act's int64 word (columns 2p and 2p + 1: the first in the low half) as two fp32."""
    first = (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    second = (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return first, second


@triton.jit
def hi_lo_pairs(first, second):
    """Two fp32 as B's (hi, lo) bf16 pairs in int32 (the first in each low half): hi their bf16 roundings, lo the
    roundings of what is left, so that hi + lo is each to ~2**-16."""
    first_hi = bf16_bits(first)
    second_hi = bf16_bits(second)
    first_lo = bf16_bits(first - low_half(first_hi))
    second_lo = bf16_bits(second - low_half(second_hi))
    return first_hi | (second_hi << 16), first_lo | (second_lo << 16)


@triton.jit
def input_values(act_ptr, norm_ptr, pair, mask, scale, ACT: tl.constexpr, K: tl.constexpr):
    """B's columns 2 * pair and 2 * pair + 1 as fp32, for ACT FP32 (act itself), NORMED (x * g: act is x, norm_ptr
    g's bf16 pairs) or GLU (silu(gate) * up of the sums scaled by `scale`, rounded to bf16 as a bf16 model rounds
    its activations; GLU_FP32 unrounded; act [2K] holds the gate's sums, then the up's). fp32 inputs are read
    through their int64 view, so that a thread's 4 pairs are one contiguous load in the fragments' layout, as a
    bf16 act's are."""
    first, second = split_pair(tl.load(act_ptr + pair, mask=mask, other=0))
    if ACT == NORMED:
        g = tl.load(norm_ptr + pair, mask=mask, other=0)
        first = first * low_half(g)
        second = second * high_half(g)
    if ACT == GLU or ACT == GLU_FP32:  # noqa: SIM109 (constexprs: no `in` in Triton's jit)
        up_first, up_second = split_pair(tl.load(act_ptr + K // 2 + pair, mask=mask, other=0))
        first = first * scale
        second = second * scale
        first = first * tl.sigmoid(first) * (up_first * scale)
        second = second * tl.sigmoid(second) * (up_second * scale)
    if ACT == GLU:
        first = bf16_rounded(first)
        second = bf16_rounded(second)
    return first, second


@triton.jit
def input_pairs(act_ptr, norm_ptr, pair, mask, scale, ACT: tl.constexpr, K: tl.constexpr):
    """B's columns 2 * pair and 2 * pair + 1 as (hi, lo) bf16 pairs in int32: a bf16 act is its own hi (lo
    unused; read through its int32 view), and so is a GLU input (bf16 values); FP32 and NORMED inputs are split
    in two bf16 parts whose sum is each to ~2**-16 (B's columns 0 and 1), and so are GLU_FP32 inputs."""
    # one return statement: the compiler types every return of a function, a constexpr branch's too
    if ACT == BF16:
        hi = tl.load(act_ptr + pair, mask=mask, other=0)
        lo = hi
    else:
        first, second = input_values(act_ptr, norm_ptr, pair, mask, scale, ACT, K)
        if ACT == GLU:
            hi = bf16_bits(first) | (bf16_bits(second) << 16)
            lo = hi
        else:
            hi, lo = hi_lo_pairs(first, second)
    return hi, lo


@triton.jit
def chunk_input_pairs(act_ptr, norm_ptr, chunk, c, scale, ACT: tl.constexpr, K: tl.constexpr):
    """B's pairs for a chunk's slots ([128] each, word c: pair 16 h + c % 16 of the chunk, h = 0 or 1), built from
    the chunk's 32 pairs one a lane and then gathered (warp shuffles): input_pairs over the slots themselves would
    build each pair 4 times in each of 8 lanes, and a GLU's SiLU and a NORMED input's split, 16 times over,
    outweigh the weights' decode."""
    p = tl.arange(0, 32)
    hi, lo = input_pairs(act_ptr, norm_ptr, chunk * 32 + p, p >= 0, scale, ACT, K)
    return (tl.gather(hi, c % 16, 0), tl.gather(hi, c % 16 + 16, 0), tl.gather(lo, c % 16, 0),
            tl.gather(lo, c % 16 + 16, 0))  # fmt: skip


@triton.jit
def exact_values(act_ptr, norm_ptr, pair, mask, scale, ACT: tl.constexpr, K: tl.constexpr):
    """input_values for every kind (the interpreter's sums, the exceptions): a bf16 act's pair widened."""
    if ACT == BF16:
        word = tl.load(act_ptr + pair, mask=mask, other=0)
        first = low_half(word)
        second = high_half(word)
    else:
        first, second = input_values(act_ptr, norm_ptr, pair, mask, scale, ACT, K)
    return first, second


@triton.jit
def act_at(act_ptr, norm_ptr, col, mask, scale, ACT: tl.constexpr, K: tl.constexpr):
    """B's column col as fp32 (from its pair)."""
    first, second = exact_values(act_ptr, norm_ptr, col // 2, mask, scale, ACT, K)
    return tl.where(col % 2 == 0, first, second)


@triton.jit
def residual_rstd(x_ptr, eps, K: tl.constexpr, X_BLOCK: tl.constexpr):
    """RMSNorm's 1 / sqrt(mean(x ** 2) + eps) of the fp32 residual [K]."""
    cols = tl.arange(0, X_BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)


@triton.jit
def row_floor(base_ptr, row, mask):
    """The floor an exception of `row` decodes to, as fp32 (floor_value of the row's top exponent bits, byte 0 or
    2 of its base word)."""
    word = tl.load(base_ptr + (row // 16) * 8 + row % 8, mask=mask, other=0)
    return floor_value((word >> (16 * ((row % 16) // 8))) & 0x7F)


@triton.jit
def exception_terms(exc_row_ptr, exc_col_ptr, exc_value_ptr, base_ptr, act_ptr, norm_ptr, idx, ok, scale,
                    ACT: tl.constexpr, K: tl.constexpr):  # fmt: skip
    """Exceptions idx (where ok) as (their rows, what each adds to its row's sum): true weight * B[col] less the
    floor's product, which the mma summed (a power of two: that product is exact); 0 where not ok."""
    row = tl.load(exc_row_ptr + idx, mask=ok, other=0)
    col = tl.load(exc_col_ptr + idx, mask=ok, other=0)
    value = tl.load(exc_value_ptr + idx, mask=ok, other=0.0)
    x = act_at(act_ptr, norm_ptr, col, ok, scale, ACT, K)
    return row, tl.where(ok, value * x - row_floor(base_ptr, row, ok) * x, 0.0)


@triton.jit
def item_chunk_loads(
    lo_ptr, code_ptr, tile, code_tile, f: tl.constexpr, CHUNKS: tl.constexpr, item_tiles, K: tl.constexpr
):
    """Chunk f of a program's stream over its items (chunk f % CHUNKS of item f // CHUNKS, whose M-tiles lie
    item_tiles on from the first item's)."""
    item: tl.constexpr = f // CHUNKS
    return chunk_loads(lo_ptr, code_ptr, tile + item * item_tiles * (K // 64) * 256,
                       code_tile + item * item_tiles * (K // 64) * 128, f % CHUNKS)  # fmt: skip


@triton.jit
def _packed_mma_gemv_kernel(act_ptr, norm_ptr, rstd_ptr, lo_ptr, code_ptr, base_ptr, exc_start_ptr, exc_row_ptr,
                            exc_col_ptr, exc_value_ptr, out_ptr, zero_ptr, zero_total, eps, hist_out_ptr,
                            hist_in_ptr, lane_start, lane_scale, K: tl.constexpr,
                            BM: tl.constexpr, AHEAD: tl.constexpr, SPLIT: tl.constexpr, ITEMS: tl.constexpr,
                            ACT: tl.constexpr, X_BLOCK: tl.constexpr, EXC_BLOCK: tl.constexpr,
                            EXC_ROUNDS: tl.constexpr, ZERO_EACH: tl.constexpr, ZERO_BLOCK: tl.constexpr,
                            LANE_TILES: tl.constexpr, FUSED_GLU: tl.constexpr, REDUCE: tl.constexpr,
                            TOTAL_LANES: tl.constexpr, STORE_HISTORY: tl.constexpr, USE_MMA: tl.constexpr,
                            USE_PDL: tl.constexpr, TRIGGER_EARLY: tl.constexpr):  # fmt: skip
    # A program takes ITEMS blocks of BM M-tiles in turn (the grid's width apart), the same 1 / SPLIT of K in
    # each, its chunks one stream with AHEAD of them in flight across the items' boundaries.
    CHUNKS: tl.constexpr = K // 64 // SPLIT
    # an input B is built from in two bf16 parts (hi and lo)
    TWO_PARTS: tl.constexpr = ACT == FP32 or ACT == NORMED or ACT == GLU_FP32  # noqa: SIM109 (no `in` in the jit)
    split = tl.program_id(1)
    k0, m, g, t, j, tile, code_tile = program_tiles(K, BM, SPLIT)
    item_tiles = tl.num_programs(0) * BM  # M-tiles from one item to the next
    bases = ()
    for it in tl.static_range(ITEMS):
        bases = bases + (tl.load(base_ptr + (m[:, None] + it * item_tiles) * 8 + g[None, :]),)  # [BM, 128]
    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    # The weights do not depend on the previous kernel: the first AHEAD chunks are in flight before its wait,
    # with the M-tiles' exception ranges (static too).
    ring = ()
    for f in tl.static_range(AHEAD):
        ring = ring + (item_chunk_loads(lo_ptr, code_ptr, tile, code_tile, f, CHUNKS, item_tiles, K),)
    exc_ranges = ()
    for it in tl.static_range(ITEMS):
        first_tile = tl.program_id(0) * BM + it * item_tiles
        exc_ranges = exc_ranges + (
            (tl.load(exc_start_ptr + first_tile), tl.load(exc_start_ptr + first_tile + BM)),
        )
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()
    program = tl.program_id(0) * SPLIT + split
    if ZERO_EACH > 0:  # a buffer a later launch adds into (its last reader finished before our wait)
        offs = program * ZERO_EACH + tl.arange(0, ZERO_BLOCK)
        tl.store(zero_ptr + offs, tl.zeros([ZERO_BLOCK], tl.float32),
                 mask=(tl.arange(0, ZERO_BLOCK) < ZERO_EACH) & (offs < zero_total))  # fmt: skip
    scale = 1.0
    # the norm's scalar, once a launch, for the GLU launch that reads these sums (a constexpr and a runtime test:
    # two statements in Triton's jit)
    if ACT == NORMED and not FUSED_GLU:  # noqa: SIM102
        if program == 0:
            tl.store(rstd_ptr, residual_rstd(act_ptr.to(tl.pointer_type(tl.float32)), eps, K, X_BLOCK))
    if ACT == GLU or ACT == GLU_FP32:  # noqa: SIM109
        scale = tl.load(rstd_ptr)

    holds_b = (g == 0)[None, :] & (m >= 0)[:, None]  # lanes 0-3: B's column 0
    zero_m = (m * 0)[:, None]  # [BM, 1] int32: broadcasts a chunk's [128] B words over the M-tiles
    for it in tl.static_range(ITEMS):
        base = bases[it]
        m_it = m + it * item_tiles
        act_it, norm_it = act_ptr, norm_ptr
        # these M-tiles are lane `lane`'s: its row of x (int64 pairs) and of g (int32 pairs)
        if LANE_TILES > 0:
            lane = (tl.program_id(0) * BM + it * item_tiles) // LANE_TILES
            act_it = act_ptr + lane * (K // 2)
            norm_it = norm_ptr + lane * (K // 2)
        rstd_it = 1.0
        if FUSED_GLU:  # loaded beside the first weights, used at the end
            rstd_it = lane_rstd(act_it.to(tl.pointer_type(tl.float32)), eps, K)
        acc = tl.zeros([BM, 128], dtype=tl.float32) + (base * 0).to(
            tl.float32
        )  # the mma's D, or rows g's sums
        acc_8 = acc  # the interpreter's sums of rows g + 8
        for i in tl.static_range(CHUNKS):
            words = ring[0]
            ring = ring[1:]
            if it * CHUNKS + i + AHEAD < ITEMS * CHUNKS:
                ring = ring + (item_chunk_loads(lo_ptr, code_ptr, tile, code_tile, it * CHUNKS + i + AHEAD, CHUNKS,
                                                item_tiles, K),)  # fmt: skip
            a = fragments(words, base, USE_MMA)
            # each slot's B pair 0 (B's columns 2 pair, 2 pair + 1); pair 1 is 16 pairs on
            pair = ((k0 + i) * 32 + 4 * t + j)[None, :] + zero_m
            if USE_MMA:
                if ACT == BF16:  # loads only, in the slots that hold B's column 0
                    hi0, lo0 = input_pairs(act_it, norm_it, pair, holds_b, scale, ACT, K)
                    hi1, lo1 = input_pairs(act_it, norm_it, pair + 16, holds_b, scale, ACT, K)
                else:  # Built again for each item (the same chunk of K): held across items it would cost
                    # CHUNKS x 4 words a lane
                    b = chunk_input_pairs(act_it, norm_it, k0 + i, tl.arange(0, 128), scale, ACT, K)
                    hi0, hi1 = b[0][None, :] + zero_m, b[1][None, :] + zero_m
                    # the lo parts in B's column 1 (lanes 4-7): one mma a K-part, not two chained
                    if TWO_PARTS:
                        hi0 = tl.where((g == 1)[None, :], b[2][None, :] + zero_m, hi0)
                        hi1 = tl.where((g == 1)[None, :], b[3][None, :] + zero_m, hi1)
                # B's columns past those read hold copies of the pairs: D's columns there are never read
                acc = tl.inline_asm_elementwise(MMA4, "=&f,=&f,=&f,=&f," + "r," * 24 + "f,f,f,f",
                                                [a[0], a[1], a[2], a[3], hi0, hi1, acc], dtype=tl.float32,
                                                is_pure=True, pack=4)  # fmt: skip
            else:
                every = m[:, None] >= 0
                x0, x1 = exact_values(act_it, norm_it, pair, every, scale, ACT, K)
                x8, x9 = exact_values(act_it, norm_it, pair + 16, every, scale, ACT, K)
                acc += low_half(a[0]) * x0 + high_half(a[0]) * x1 + low_half(a[2]) * x8 + high_half(a[2]) * x9
                acc_8 += (
                    low_half(a[1]) * x0 + high_half(a[1]) * x1 + low_half(a[3]) * x8 + high_half(a[3]) * x9
                )

        exc_first, exc_end = exc_ranges[it]
        if FUSED_GLU:  # rows g and g + 8 of each M-tile are a gate row and its up row: h stored whole here
            # D's columns 0 + 1: slots 0 + 1 (row g) and 2 + 3 (row g + 8) of lanes q = 0, 4, ..., 28
            if USE_MMA:
                pair_sums = tl.sum(tl.reshape(acc, [BM, 64, 2]), axis=2)  # [BM, 64]: p = c // 2, lane p // 2
                half = (tl.arange(0, 64) % 2)[None, :]
                # [BM, 32] each, by lane q
                gate = tl.sum(tl.reshape(tl.where(half == 0, pair_sums, 0.0), [BM, 32, 2]), axis=2)
                up = tl.sum(tl.reshape(tl.where(half == 1, pair_sums, 0.0), [BM, 32, 2]), axis=2)
                q = tl.arange(0, 32)
                glu_store(gate, up, q // 4, q % 4 == 0, m_it, rstd_it, out_ptr, act_it, norm_it, base_ptr,
                          exc_row_ptr, exc_col_ptr, exc_value_ptr, exc_first, exc_end, K, LANE_TILES, EXC_BLOCK,
                          EXC_ROUNDS)  # fmt: skip
            else:  # row g's terms are the 16 words c of 16 g .. 16 g + 15
                gate = tl.sum(tl.reshape(acc, [BM, 8, 16]), axis=2)  # [BM, 8]
                up = tl.sum(tl.reshape(acc_8, [BM, 8, 16]), axis=2)
                g8 = tl.arange(0, 8)
                glu_store(gate, up, g8, g8 >= 0, m_it, rstd_it, out_ptr, act_it, norm_it, base_ptr, exc_row_ptr,
                          exc_col_ptr, exc_value_ptr, exc_first, exc_end, K, LANE_TILES, EXC_BLOCK,
                          EXC_ROUNDS)  # fmt: skip
        elif REDUCE != NO_REDUCE:  # a lane's rows over all of K: reduced and stored here
            if USE_MMA and TWO_PARTS:  # D's columns 0 + 1, as the atomic branch below reads them
                pair_sums = tl.sum(tl.reshape(acc, [BM, 64, 2]), axis=2)  # [BM, 64]
                p = tl.arange(0, 64)
                rows = m_it[:, None] * 16 + (p // 8 + 8 * (p % 2))[None, :]
                keep = (p // 2 % 4 == 0)[None, :] & (rows >= 0)
                lane_reduce_store(pair_sums, rows, keep, out_ptr, hist_out_ptr, hist_in_ptr, act_it, base_ptr,
                                  exc_row_ptr, exc_col_ptr, exc_value_ptr, exc_first, exc_end, lane_start, lane_scale,
                                  K, ACT, LANE_TILES * 16, REDUCE, TOTAL_LANES, STORE_HISTORY, EXC_BLOCK,
                                  EXC_ROUNDS)  # fmt: skip
            elif USE_MMA:  # D's column 0: slots 0 and 2 of lanes 0, 4, ..., 28 (the others' rows are masked)
                rows = m_it[:, None] * 16 + g[None, :] + 8 * (j[None, :] // 2)
                keep = ((t == 0) & (j % 2 == 0))[None, :] & (rows >= 0)
                lane_reduce_store(acc, rows, keep, out_ptr, hist_out_ptr, hist_in_ptr, act_it, base_ptr, exc_row_ptr,
                                  exc_col_ptr, exc_value_ptr, exc_first, exc_end, lane_start, lane_scale, K, ACT,
                                  LANE_TILES * 16, REDUCE, TOTAL_LANES, STORE_HISTORY, EXC_BLOCK,
                                  EXC_ROUNDS)  # fmt: skip
            else:  # row g's terms are the 16 words c of 16 g .. 16 g + 15; rows g and g + 8 side by side
                sums = tl.reshape(tl.join(tl.sum(tl.reshape(acc, [BM, 8, 16]), axis=2),
                                          tl.sum(tl.reshape(acc_8, [BM, 8, 16]), axis=2)), [BM, 16])  # fmt: skip
                c = tl.arange(0, 16)
                rows = m_it[:, None] * 16 + (c // 2 + 8 * (c % 2))[None, :]
                lane_reduce_store(sums, rows, rows >= 0, out_ptr, hist_out_ptr, hist_in_ptr, act_it, base_ptr,
                                  exc_row_ptr, exc_col_ptr, exc_value_ptr, exc_first, exc_end, lane_start, lane_scale,
                                  K, ACT, LANE_TILES * 16, REDUCE, TOTAL_LANES, STORE_HISTORY, EXC_BLOCK,
                                  EXC_ROUNDS)  # fmt: skip
        # D's columns 0 and 1 (the hi and lo parts' sums): slots 0 + 1 (row g) and 2 + 3 (row g + 8) of lanes
        # 0, 4, ..., 28; p = c // 2 sums lane p // 2's slots 2 (p % 2) and 2 (p % 2) + 1
        elif USE_MMA and TWO_PARTS:
            pair_sums = tl.sum(tl.reshape(acc, [BM, 64, 2]), axis=2)  # [BM, 64]
            p = tl.arange(0, 64)
            rows = m_it[:, None] * 16 + (p // 8 + 8 * (p % 2))[None, :]
            keep = (p // 2 % 4 == 0)[None, :] & (rows >= 0)
            tl.atomic_add(out_ptr + rows, pair_sums, mask=keep, sem="relaxed")
        elif USE_MMA:  # D's column 0: slots 0 and 2 of lanes 0, 4, ..., 28
            rows = m_it[:, None] * 16 + g[None, :] + 8 * (j[None, :] // 2)
            keep = ((t == 0) & (j % 2 == 0))[None, :] & (rows >= 0)
            tl.atomic_add(out_ptr + rows, acc, mask=keep, sem="relaxed")
        else:  # row g's terms are the 16 words c of 16 g .. 16 g + 15
            rows = m_it[:, None] * 16 + tl.arange(0, 8)[None, :]
            tl.atomic_add(out_ptr + rows, tl.sum(tl.reshape(acc, [BM, 8, 16]), axis=2), sem="relaxed")
            tl.atomic_add(out_ptr + rows + 8, tl.sum(tl.reshape(acc_8, [BM, 8, 16]), axis=2), sem="relaxed")

        if not FUSED_GLU and REDUCE == NO_REDUCE:
            # The exceptions of these M-tiles, a share of them each split: true weight * B[col] less the floor's
            # product, which the mma summed (a power of two: that product is exact).
            share = (exc_end - exc_first + SPLIT - 1) // SPLIT
            own_first = exc_first + split * share
            own_end = tl.minimum(own_first + share, exc_end)
            for r in tl.static_range(EXC_ROUNDS):
                idx = own_first + r * EXC_BLOCK + tl.arange(0, EXC_BLOCK)
                ok = idx < own_end
                row, term = exception_terms(exc_row_ptr, exc_col_ptr, exc_value_ptr, base_ptr, act_ptr, norm_ptr,
                                            idx, ok, scale, ACT, K)  # fmt: skip
                tl.atomic_add(out_ptr + row, term, mask=ok, sem="relaxed")


@triton.jit
def glu_store(gate, up, g, valid, m_it, rstd, h_ptr, act_ptr, norm_ptr, base_ptr, exc_row_ptr, exc_col_ptr,
              exc_value_ptr, exc_first, exc_end, K: tl.constexpr, LANE_TILES: tl.constexpr, EXC_BLOCK: tl.constexpr,
              EXC_ROUNDS: tl.constexpr):  # fmt: skip
    """A fused gate/up's end: gate and up [BM, G] are the sums W @ (x * g) of rows 16 m + g and 16 m + 8 + g of
    M-tiles m_it [BM] (where valid), the rows of W laid out by pack_glu; their exceptions added, then
    h[lane, f] = silu(rstd * gate) * (rstd * up) at f = 8 (m % LANE_TILES) + g, rstd the lane's RMSNorm scalar
    (the lane of every M-tile of the block)."""
    gate_rows = m_it[:, None] * 16 + g[None, :]  # [BM, G] rows of W
    for r in tl.static_range(EXC_ROUNDS):
        idx = exc_first + r * EXC_BLOCK + tl.arange(0, EXC_BLOCK)
        ok = idx < exc_end
        row, term = exception_terms(exc_row_ptr, exc_col_ptr, exc_value_ptr, base_ptr, act_ptr, norm_ptr, idx, ok,
                                    1.0, NORMED, K)  # fmt: skip
        at = row[None, None, :]  # [1, 1, EXC_BLOCK] against [BM, G, 1]
        gate += tl.sum(tl.where(at == gate_rows[:, :, None], term[None, None, :], 0.0), axis=2)
        up += tl.sum(tl.where(at == gate_rows[:, :, None] + 8, term[None, None, :], 0.0), axis=2)
    gate = gate * rstd
    h = gate * tl.sigmoid(gate) * (up * rstd)
    lane = m_it // LANE_TILES
    f = lane[:, None] * (8 * LANE_TILES) + (m_it % LANE_TILES)[:, None] * 8 + g[None, :]
    tl.store(h_ptr + f, h.to(h_ptr.dtype.element_ty), mask=valid[None, :] & (m_it >= 0)[:, None])


@triton.jit
def lane_reduce_store(p, rows, keep, x_ptr, hist_out_ptr, hist_in_ptr, act_ptr, base_ptr, exc_row_ptr, exc_col_ptr,
                      exc_value_ptr, exc_first, exc_end, lane_start, lane_scale, K: tl.constexpr,
                      ACT: tl.constexpr, LANE_ROWS: tl.constexpr, REDUCE: tl.constexpr, TOTAL_LANES: tl.constexpr,
                      STORE_HISTORY: tl.constexpr, EXC_BLOCK: tl.constexpr, EXC_ROUNDS: tl.constexpr):  # fmt: skip
    """A lane-reduced launch's end: p [BM, C] the sums of W's rows `rows` (where keep), W the launch's lanes'
    matrices stacked (row = lane * LANE_ROWS + n), act_ptr the lane's input (ACT: BF16 or FP32). Their exceptions
    added, p is stored in history_out where it is kept, then lane_reduce_gemv's rule applied to x [lanes,
    LANE_ROWS] at the same rows: DELAYED x[l, n] += p + the other lanes' partials of history_in [TOTAL_LANES,
    LANE_ROWS]; SCALED x[l, n] += lane_scale * p. l counts from lane_start in the histories."""
    for r in tl.static_range(EXC_ROUNDS):
        idx = exc_first + r * EXC_BLOCK + tl.arange(0, EXC_BLOCK)
        ok = idx < exc_end
        row, term = exception_terms(exc_row_ptr, exc_col_ptr, exc_value_ptr, base_ptr, act_ptr, act_ptr, idx, ok,
                                    1.0, ACT, K)  # fmt: skip
        p += tl.sum(tl.where(row[None, None, :] == rows[:, :, None], term[None, None, :], 0.0), axis=2)
    x = tl.load(x_ptr + rows, mask=keep, other=0.0)
    lane = lane_start + rows // LANE_ROWS
    n = rows % LANE_ROWS
    if STORE_HISTORY:  # whatever the mode: a later delayed layer may read a scaled one's partials
        tl.store(hist_out_ptr + lane * LANE_ROWS + n, p, mask=keep)
    if REDUCE == DELAYED:
        for other in tl.static_range(TOTAL_LANES):
            p += tl.load(hist_in_ptr + other * LANE_ROWS + n, mask=keep & (lane != other), other=0.0)
        x += p
    else:
        x += lane_scale * p
    tl.store(x_ptr + rows, x, mask=keep)


@triton.jit
def lane_rstd(x_ptr, eps, K: tl.constexpr):
    """RMSNorm's 1 / sqrt(mean(x ** 2) + eps) of an fp32 row [K] (K % 64 == 0), 256 columns at a time: a
    program of one warp holds no more."""
    total = tl.zeros([256], dtype=tl.float32)
    for i in tl.static_range(0, K, 256):
        cols = i + tl.arange(0, 256)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        total += x * x
    return 1.0 / tl.sqrt(tl.sum(total, axis=0) / K + eps)


def pick_split(chunks: int, most: int = 4) -> int:
    """The fewest programs along K that leave each at most `most` chunks (of a divisor of the chunks): 4 chunks
    a program ran fastest for the o-proj and the down-proj of qwen3-1.7b and llama-3.2-1b (more chunks leave
    too few programs, fewer make each one's fixed cost count)."""
    return next(s for s in range(1, chunks + 1) if chunks % s == 0 and chunks // s <= most)


def packed_mma_gemv(act: torch.Tensor, packed: MmaPackedWeight, out: torch.Tensor, *,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, glu: torch.dtype | None = None,
                    rstd: torch.Tensor | None = None, zero: torch.Tensor | None = None, split: int | None = None,
                    block_m: int | None = None, ahead: int = 8, items: int = 1, use_pdl: bool = False,
                    trigger_early: bool = False) -> torch.Tensor:  # fmt: skip
    """out += W @ B, out [N] fp32 contiguous, B by the arguments:
    - act [K] bf16, or fp32 (B in a bf16 hi and lo part, its columns 0 and 1): act itself;
    - norm_weight [K] bf16 and rstd [1] fp32: act is the fp32 residual x [K] and B is x * norm_weight (hi and
      lo), so out += W @ (x * g), RMSNorm's scalar left out: the launch writes it, 1 / sqrt(mean(x ** 2) + eps),
      into rstd for the reader of these sums (the gate/up);
    - glu (bf16 or fp32: the model's activations) and rstd: act is the fp32 [2K] a normed launch added into
      (gate rows, then up rows) and B is silu(rstd * gate) * (rstd * up) rounded to glu (the down-proj after it;
      fp32 as a hi and lo part).
    zero: an fp32 buffer the launch clears after its wait (a later launch adds into it). split: programs along K
    (a divisor of K / 64; None: pick_split); block_m: M-tiles a program (a warp each; a power of two dividing
    N / 16; None: 1 on a GPU, up to 8 under the interpreter); ahead: chunks a program loads before it waits on
    the previous kernel, and keeps in flight; items: blocks of block_m M-tiles a program takes in turn (fewer
    programs, so the next launch's find room sooner)."""
    n, k = packed.shape
    if glu not in (None, torch.bfloat16, torch.float32):
        raise ValueError(f"glu: expected bf16 or fp32 (the model's activations) or None, got {glu}")
    width = 2 * k if glu is not None else k
    if act.shape != (width,) or not act.is_contiguous() or act.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"act: expected a contiguous [{width}] bf16 or fp32, got {act.dtype} {tuple(act.shape)}"
        )
    if out.shape != (n,) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out: expected a contiguous [{n}] fp32, got {out.dtype} {tuple(out.shape)}")
    if norm_weight is not None and (
        glu is not None
        or act.dtype != torch.float32
        or norm_weight.shape != (k,)
        or norm_weight.dtype != torch.bfloat16
        or not norm_weight.is_contiguous()
    ):
        raise ValueError(f"norm_weight: expected a contiguous [{k}] bf16 beside an fp32 act (no glu), got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}")  # fmt: skip
    if glu is not None and act.dtype != torch.float32:
        raise ValueError("glu: act must be the fp32 sums of a normed launch")
    if (glu is not None or norm_weight is not None) != (rstd is not None):
        raise ValueError("rstd: a normed or glu launch takes it (the norm's scalar), another does not")
    if rstd is not None and (rstd.shape != (1,) or rstd.dtype != torch.float32):
        raise ValueError(f"rstd: expected a [1] fp32, got {rstd.dtype} {tuple(rstd.shape)}")
    if zero is not None and (zero.dtype != torch.float32 or not zero.is_contiguous()):
        raise ValueError(f"zero: expected a contiguous fp32 buffer, got {zero.dtype}")
    chunks, m_tiles = k // CHUNK, n // 16
    split = split or pick_split(chunks)
    if chunks % split:
        raise ValueError(f"split: {split} does not divide the {chunks} chunks of K = {k}")
    if block_m is None:
        block_m = 1
        while interpreted() and block_m < 8 and m_tiles % (2 * block_m * items) == 0:
            block_m *= 2
    if block_m < 1 or block_m & (block_m - 1) or m_tiles % block_m:
        raise ValueError(f"block_m: {block_m} is not a power of two dividing the {m_tiles} M-tiles")
    if ahead < 1:
        raise ValueError(f"ahead: expected at least 1, got {ahead}")
    if items < 1 or m_tiles % (block_m * items):
        raise ValueError(f"items: {items} blocks of {block_m} M-tiles do not divide the {m_tiles} M-tiles")
    if glu is not None:
        kind = GLU if glu == torch.bfloat16 else GLU_FP32
    else:
        kind = NORMED if norm_weight is not None else FP32 if act.dtype == torch.float32 else BF16
    programs = m_tiles // block_m // items * split
    zero_each = triton.cdiv(zero.numel(), programs) if zero is not None else 0
    _packed_mma_gemv_kernel[(m_tiles // block_m // items, split)](
        act.view(torch.int32 if kind == BF16 else torch.int64),
        norm_weight.view(torch.int32) if norm_weight is not None else act, rstd if rstd is not None else out,
        packed.lo, packed.codes, packed.base, packed.exc_start, packed.exc_row, packed.exc_col, packed.exc_value,
        out, zero if zero is not None else out, zero.numel() if zero is not None else 0, eps, out, out, 0, 1.0,
        K=k, BM=block_m,
        AHEAD=min(ahead, items * chunks // split), SPLIT=split, ITEMS=items, ACT=kind, X_BLOCK=triton.next_power_of_2(k),
        EXC_BLOCK=EXC_BLOCK, EXC_ROUNDS=packed.exception_rounds(block_m, split), ZERO_EACH=zero_each,
        ZERO_BLOCK=triton.next_power_of_2(max(zero_each, 1)), LANE_TILES=0, FUSED_GLU=False, REDUCE=NO_REDUCE,
        TOTAL_LANES=1, STORE_HISTORY=False,
        USE_MMA=not interpreted(), USE_PDL=use_pdl, TRIGGER_EARLY=trigger_early, num_warps=block_m,
        **pdl_kwargs(use_pdl),
    )  # fmt: skip
    return out


def pack_glu(w1: torch.Tensor, w3: torch.Tensor) -> MmaPackedWeight:
    """The gate/up of every lane, w1 and w3 [L, F, K] bf16 (F % 8 == 0, K % 64 == 0), as one packed [2 L F, K]
    matrix for packed_glu_gemv: lane l's rows come in its own 2F / 16 M-tiles, and M-tile m of a lane holds gate
    rows 8m .. 8m + 7 in its rows g and up rows 8m .. 8m + 7 in its rows g + 8, the two rows the same thread's
    mma sums."""
    if w1.dim() != 3 or w1.shape != w3.shape:
        raise ValueError(f"w1, w3: expected two [L, F, K] matrices, got {tuple(w1.shape)}, {tuple(w3.shape)}")
    lanes, f, k = w1.shape
    if f % 8 or not fits(2 * f, k):
        raise ValueError(f"w1, w3: [{f}, {k}] a lane is not whole blocks of 8 rows by 64-column chunks")
    blocks = torch.stack([w1.reshape(lanes, f // 8, 8, k), w3.reshape(lanes, f // 8, 8, k)], dim=2)
    return pack_mma(blocks.reshape(lanes * 2 * f, k).contiguous())


def packed_glu_gemv(x: torch.Tensor, packed: MmaPackedWeight, h: torch.Tensor, norm_weight: torch.Tensor, *,
                    eps: float = 1e-6, block_m: int | None = None, ahead: int = 8, use_pdl: bool = False,
                    trigger_early: bool = False) -> torch.Tensor:  # fmt: skip
    """A Laneformer's gate/up with its norm and SiLU, the weights in 12 bits (pack_glu's layout):

        h[l] = silu(W1[l] @ n[l]) * (W3[l] @ n[l]),  n[l] = RMSNorm(x[l]) * norm_weight[l]

    x [L, K] fp32 (the residual), norm_weight [L, K] bf16, h [L, F] (bf16, or fp32) overwritten. A program takes
    block_m M-tiles of one lane over all of K, so that it holds both sums of its rows and stores h itself: no
    atomics, no buffer to clear, and the down-proj reads h as it reads rmsnorm_gemv's."""
    lanes, k = x.shape
    n = packed.n
    if packed.k != k or n % (2 * lanes):
        raise ValueError(f"packed: [{n}, {packed.k}] is not the gate/up of {lanes} lanes of width {k}")
    f = n // (2 * lanes)
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous fp32 [{lanes}, {k}], got {x.dtype} {tuple(x.shape)}")
    if norm_weight.shape != (lanes, k) or norm_weight.dtype != torch.bfloat16 or not norm_weight.is_contiguous():  # fmt: skip
        raise ValueError(f"norm_weight: expected a contiguous bf16 [{lanes}, {k}], got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    if h.shape != (lanes, f) or not h.is_contiguous() or h.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"h: expected a contiguous [{lanes}, {f}] bf16 or fp32, got {h.dtype} {h.shape}")
    lane_tiles = 2 * f // 16
    block_m = lane_block_m(block_m, lane_tiles, ahead)
    chunks = k // CHUNK
    _packed_mma_gemv_kernel[(n // 16 // block_m, 1)](
        x.view(torch.int64), norm_weight.view(torch.int32), h, packed.lo, packed.codes, packed.base,
        packed.exc_start, packed.exc_row, packed.exc_col, packed.exc_value, h, h, 0, eps, h, h, 0, 1.0, K=k,
        BM=block_m, AHEAD=min(ahead, chunks), SPLIT=1, ITEMS=1, ACT=NORMED, X_BLOCK=triton.next_power_of_2(k),
        EXC_BLOCK=EXC_BLOCK, EXC_ROUNDS=packed.exception_rounds(block_m, 1), ZERO_EACH=0, ZERO_BLOCK=1,
        LANE_TILES=lane_tiles, FUSED_GLU=True, REDUCE=NO_REDUCE, TOTAL_LANES=1, STORE_HISTORY=False,
        USE_MMA=not interpreted(), USE_PDL=use_pdl, TRIGGER_EARLY=trigger_early, num_warps=block_m,
        **pdl_kwargs(use_pdl),
    )  # fmt: skip
    return h


def lane_block_m(block_m: int | None, lane_tiles: int, ahead: int) -> int:
    """A launch over lanes' M-tiles: block_m checked (None: 1 on a GPU, up to 8 dividing a lane's tiles under
    the interpreter), and ahead."""
    if block_m is None:
        block_m = 1
        while interpreted() and block_m < 8 and lane_tiles % (2 * block_m) == 0:
            block_m *= 2
    if block_m < 1 or block_m & (block_m - 1) or lane_tiles % block_m:
        raise ValueError(f"block_m: {block_m} is not a power of two dividing a lane's {lane_tiles} M-tiles")
    if ahead < 1:
        raise ValueError(f"ahead: expected at least 1, got {ahead}")
    return block_m


def packed_lane_reduce_gemv(act: torch.Tensor, packed: MmaPackedWeight, x: torch.Tensor, *, mode: str,
                            history_out: torch.Tensor | None = None, history_in: torch.Tensor | None = None,
                            lane_start: int = 0, total_lanes: int | None = None, block_m: int | None = None,
                            ahead: int = 8, use_pdl: bool = False,
                            trigger_early: bool = False) -> torch.Tensor:  # fmt: skip
    """kernels/lane_reduce_gemv.py's 'delayed' and 'scaled' launches with the weights in 12 bits: a Laneformer's
    o-proj or down-proj of layers i >= d (the runner packs the down-proj). packed: pack_mma(weight.reshape(L * N,
    K)) of weight [L, N, K]; act [L, K] bf16 (or fp32: B in a bf16 hi and lo part); x [L, N] fp32, updated in
    place; history_out, history_in, lane_start, total_lanes as there. A program takes block_m M-tiles of one lane
    over all of K, so it holds its rows' whole partials: it stores them and adds the reduction itself, no atomics
    (as packed_glu_gemv)."""
    lanes, k = act.shape
    n = x.shape[1] if x.dim() == 2 else 0
    if mode not in ("delayed", "scaled"):
        raise ValueError(
            f"mode: expected 'delayed' or 'scaled' (a 'sum' needs every lane's partial), got {mode!r}"
        )
    if packed.shape != (lanes * n, k):
        raise ValueError(f"packed: [{packed.n}, {packed.k}] is not {lanes} lanes of [{n}, {k}]")
    if act.dtype not in (torch.bfloat16, torch.float32) or not act.is_contiguous():
        raise ValueError(
            f"act: expected a contiguous bf16 or fp32 [{lanes}, {k}], got {act.dtype} {tuple(act.shape)}"
        )
    if x.shape != (lanes, n) or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"x: expected a contiguous fp32 [{lanes}, {n}], got {x.dtype} {tuple(x.shape)}")
    total = total_lanes or lanes
    check_lanes(mode, lanes, n, lane_start, total, history_out, history_in)
    lane_tiles = n // 16
    block_m = lane_block_m(block_m, lane_tiles, ahead)
    bf16 = act.dtype == torch.bfloat16
    _packed_mma_gemv_kernel[(lanes * lane_tiles // block_m, 1)](
        act.view(torch.int32 if bf16 else torch.int64), act, x, packed.lo, packed.codes, packed.base,
        packed.exc_start, packed.exc_row, packed.exc_col, packed.exc_value, x, x, 0, 0.0,
        history_out if history_out is not None else x, history_in if history_in is not None else x, lane_start,
        float(total) ** 0.5, K=k, BM=block_m, AHEAD=min(ahead, k // CHUNK), SPLIT=1, ITEMS=1,
        ACT=BF16 if bf16 else FP32, X_BLOCK=1, EXC_BLOCK=EXC_BLOCK, EXC_ROUNDS=packed.exception_rounds(block_m, 1),
        ZERO_EACH=0, ZERO_BLOCK=1, LANE_TILES=lane_tiles, FUSED_GLU=False,
        REDUCE=DELAYED if mode == "delayed" else SCALED, TOTAL_LANES=total, STORE_HISTORY=history_out is not None,
        USE_MMA=not interpreted(), USE_PDL=use_pdl, TRIGGER_EARLY=trigger_early, num_warps=block_m,
        **pdl_kwargs(use_pdl),
    )  # fmt: skip
    return x
