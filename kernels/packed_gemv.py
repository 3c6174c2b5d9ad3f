"""A matrix-vector product over bf16 weights stored losslessly in 12 bits each (a probe of fewer bytes a token).

    y[n] = epilogue( sum_k W[n, k] * x[k] * g[k] * rstd ),  W exactly the bf16 matrix it was packed from

Why it can be exact: a bf16 number is a sign, 8 exponent bits and 7 mantissa bits, and within one row of a weight
matrix the exponents crowd below the row's largest. The low byte (the exponent's last bit and the mantissa) is
kept as it is; the high byte (the sign and the exponent's top 7 bits) becomes a 4-bit code, the sign and how far
the top 7 bits lie below the row's largest (0..7, i.e. 16 binades). A weight further down than that (under
~2**-14 of the row's largest, zeros included; ~1e-4 of a random matrix's weights) is an exception: its code
decodes to the window's floor with a zero low byte, and its true value is kept in a per-row list: the kernel adds
true value * x and takes away floor * x (a power of two, so that product is exact), and every row's sum is that of
the bf16 row up to fp32 rounding (in another order, as any change of block shape gives).

Layout (pack_weight): the columns go by tiles of TILE_K; a tile's 8 planes j = 0..7 are its columns
[j * G, (j + 1) * G) (G = TILE_K / 8), so x is read in contiguous slices. Per row and tile:
- lo: 2 * G int32 words; word a * G + g holds the low bytes of planes 4a .. 4a + 3 at group g (byte b: plane
  4a + b);
- codes: G int32 words; word g holds the 8 codes of group g, plane 4a + b's at nibble 2b + a, so that
  `words >> 4a & 0x0F0F0F0F` lines the codes of lo word a up byte for byte.
A program decodes 4 weights a word with integer arithmetic on the whole word (each byte's result lies in 0..255,
so the word holds them side by side) and a byte permute that interleaves the low and high bytes into two bf16
numbers (`prmt` on the GPU), then widens each to fp32 for an FFMA. docs/fast-path.md: ~8-9 instructions a
weight in all, which keeps it from streaming faster than the bf16 kernels; kernels/packed_mma_gemv.py feeds the
same pairs to the tensor cores instead.

Bytes: 1.5 a weight (bf16: 2) plus 4 a row and 8 for each slot of the exception lists (as many a row as the row
with the most has).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs, sm_count

WINDOW = 7  # the deepest code: the top 7 exponent bits at most this far below the row's largest
# prmt(lo, hi) numbers lo's bytes 0-3 and hi's 4-7: bytes [L0, H0, L1, H1], and [L2, H2, L3, H3]
_PRMT_PAIR_0 = tl.constexpr("prmt.b32 $0, $1, $2, 0x5140;")
_PRMT_PAIR_1 = tl.constexpr("prmt.b32 $0, $1, $2, 0x7362;")


@dataclass
class PackedWeight:
    """A [N, K] bf16 matrix in 12 bits a weight (see the module docstring); `shape` is (N, K)."""

    lo: torch.Tensor  # [N, K / 4] int32
    codes: torch.Tensor  # [N, K / 8] int32
    base: torch.Tensor  # [N] int32: the row's top exponent bits, repeated in each of the 4 bytes
    exc_col: (
        torch.Tensor
    )  # [N, E] int32: each row's exceptions' columns, -1 past its last (E: the most a row has)
    exc_value: torch.Tensor  # [N, E] fp32: their true weights (each decodes to its row's floor)
    tile_k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.lo.shape[0], self.lo.shape[1] * 4

    @property
    def exceptions(self) -> int:
        return int((self.exc_col >= 0).sum())

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.lo, self.codes, self.base, self.exc_col, self.exc_value)
        )


def pick_tile_k(k: int) -> int:
    """The largest power of two up to 2,048 that divides K, at least 64 (8 planes of 8 groups)."""
    tile = 2048
    while tile >= 64 and k % tile:
        tile //= 2
    if tile < 64:
        raise ValueError(f"K = {k}: a packed matrix needs K a multiple of 64")
    return tile


def encode_rows(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The 12-bit encoding of a [N, K] bf16 matrix, element by element (any column order gives the same codes):
    its bits, low bytes and 4-bit codes ([N, K] int32, exceptions already at code 7 and low byte 0), the rows'
    bases ([N], the top 7 exponent bits of each row's largest, at least 7 so that no byte of base - depth goes
    under 0) and the exceptions' mask ([N, K] bool)."""
    bits = weight.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    low, top, sign = bits & 0xFF, (bits >> 8) & 0x7F, bits >> 15
    base = top.amax(dim=1).clamp(min=WINDOW)
    depth = base[:, None] - top
    exception = depth > WINDOW
    code = torch.where(exception, WINDOW, sign * 8 + depth)
    return bits, torch.where(exception, 0, low), code, base, exception


def row_floors(base: torch.Tensor) -> torch.Tensor:
    """The bf16 bits an exception decodes to, a row's floor (sign 0, top bits base - 7, low byte 0): a power of
    two, or 0 when the whole row is (so an all-zero row has no exception)."""
    return (base - WINDOW) << 8


def as_int32_words(words: torch.Tensor) -> torch.Tensor:
    """32-bit patterns held in int64 as the int32 tensor of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pack_weight(weight: torch.Tensor, tile_k: int | None = None) -> PackedWeight:
    """weight: [N, K] bf16 -> its PackedWeight, on the same device. Exact: unpack_weight gives it back."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"weight: expected a [N, K] bf16 matrix, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    tile_k = tile_k or pick_tile_k(k)
    if tile_k % 64 or k % tile_k:
        raise ValueError(f"tile_k: {tile_k} must be a multiple of 64 dividing K = {k}")
    bits, low, code, base, exception = encode_rows(weight)
    keep = exception & (bits != row_floors(base)[:, None])
    rows, cols = keep.nonzero(as_tuple=True)  # row-major: each row's exceptions in a run
    counts = torch.bincount(rows, minlength=n)
    width = triton.next_power_of_2(max(1, int(counts.max())))
    slot = torch.arange(len(rows), device=weight.device) - (counts.cumsum(0) - counts)[rows]
    exc_col = torch.full((n, width), -1, dtype=torch.int32, device=weight.device)
    exc_value = torch.zeros(n, width, device=weight.device)
    exc_col[rows, slot] = cols.to(torch.int32)
    exc_value[rows, slot] = weight[rows, cols].float()

    tiles, groups = k // tile_k, tile_k // 8
    # column t * tile_k + j * G + g -> [N, tiles, a, b, g] with j = 4a + b
    low = low.view(n, tiles, 2, 4, groups).permute(
        0, 1, 2, 4, 3
    )  # [N, tiles, a, g, b]: byte b of word (a, g)
    lo = low.to(torch.uint8).contiguous().view(torch.int32).view(n, k // 4)
    nibbles = code.view(n, tiles, 2, 4, groups).permute(0, 1, 4, 3, 2)  # [N, tiles, g, b, a]: nibble 2b + a
    nibbles = nibbles.reshape(n, tiles, groups, 8)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int64)
    words = (nibbles.to(torch.int64) << shifts).sum(-1)  # [N, tiles, G], 32 bits each
    codes = as_int32_words(words).view(n, k // 8)
    return PackedWeight(lo=lo, codes=codes, base=(base * 0x01010101).to(torch.int32), exc_col=exc_col,
                        exc_value=exc_value, tile_k=tile_k)  # fmt: skip


def unpack_weight(packed: PackedWeight) -> torch.Tensor:
    """The bf16 [N, K] matrix a PackedWeight holds (torch only: the layout's reference for the tests)."""
    n, k = packed.shape
    tiles, groups = k // packed.tile_k, packed.tile_k // 8
    low = packed.lo.view(torch.uint8).view(n, tiles, 2, groups, 4).permute(0, 1, 2, 4, 3).to(torch.int32)
    words = packed.codes.view(n, tiles, groups).to(torch.int64) & 0xFFFFFFFF
    nibbles = (words[..., None] >> torch.arange(0, 32, 4, device=words.device)) & 0xF  # [N, tiles, G, 8]
    code = nibbles.view(n, tiles, groups, 4, 2).permute(0, 1, 4, 3, 2).to(torch.int32)  # [N, tiles, a, b, g]
    base = (packed.base & 0x7F).view(n, 1, 1, 1, 1)
    top = (code >> 3) << 7 | (base - (code & 7))
    bits = (top << 8 | low).reshape(n, k)
    weight = bits.to(torch.int16).view(torch.bfloat16).float()
    rows, slots = (packed.exc_col >= 0).nonzero(as_tuple=True)
    weight[rows, packed.exc_col[rows, slots].long()] = packed.exc_value[rows, slots]
    return weight.to(torch.bfloat16)


@triton.jit
def packed_tiles(lo_ptr, code_ptr, rows, row_ok, groups, K: tl.constexpr, TILE_K: tl.constexpr,
                 FIRST: tl.constexpr, COUNT: tl.constexpr):  # fmt: skip
    """Loads of tiles FIRST .. FIRST + COUNT - 1 of the rows: per tile (lo word 0, lo word 1, codes), each
    [BLOCK_N, G] int32. Read once a token: evicted first."""
    G: tl.constexpr = TILE_K // 8
    lo_row = lo_ptr + rows.to(tl.int64)[:, None] * (K // 4) + groups[None, :]
    code_row = code_ptr + rows.to(tl.int64)[:, None] * (K // 8) + groups[None, :]
    mask = row_ok[:, None]
    tiles = ()
    for t in tl.static_range(FIRST, FIRST + COUNT):
        lo0 = tl.load(lo_row + t * 2 * G, mask=mask, other=0, eviction_policy="evict_first")
        lo1 = tl.load(lo_row + t * 2 * G + G, mask=mask, other=0, eviction_policy="evict_first")
        codes = tl.load(code_row + t * G, mask=mask, other=0, eviction_policy="evict_first")
        tiles = tiles + ((lo0, lo1, codes),)
    return tiles


@triton.jit
def row_statics(base_ptr, exc_col_ptr, exc_value_ptr, rows, row_ok, EXC: tl.constexpr):
    """A block's bases ([BLOCK_N] int32) and its rows' exceptions (columns and true weights, [BLOCK_N, EXC]):
    static data, loaded before the wait so that only the x gather is left after it."""
    base = tl.load(base_ptr + rows, mask=row_ok, other=0)
    slots = rows[:, None] * EXC + tl.arange(0, EXC)[None, :]
    col = tl.load(exc_col_ptr + slots, mask=row_ok[:, None], other=-1)
    value = tl.load(exc_value_ptr + slots, mask=row_ok[:, None], other=0.0)
    return base, (col, value)


@triton.jit
def bf16_pair(lo, hi, PAIR: tl.constexpr, USE_ASM: tl.constexpr):
    """Bytes 2 * PAIR and 2 * PAIR + 1 of lo (low bytes) and hi (high bytes) as two bf16 numbers in one int32
    word, the first in the low half: one prmt on the GPU; shifts and masks under the interpreter."""
    if USE_ASM:
        if PAIR == 0:
            return tl.inline_asm_elementwise(
                _PRMT_PAIR_0, "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
            )
        return tl.inline_asm_elementwise(
            _PRMT_PAIR_1, "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
        )
    first = ((lo >> (16 * PAIR)) & 0xFF) | (((hi >> (16 * PAIR)) & 0xFF) << 8)
    second = ((lo >> (16 * PAIR + 8)) & 0xFF) | (((hi >> (16 * PAIR + 8)) & 0xFF) << 8)
    return first | (second << 16)


@triton.jit
def high_bytes(codes, base, A: tl.constexpr):
    """The high bytes (sign and top exponent bits) of the 4 weights of low-byte word A, from their codes word
    (nibble 2b + A: weight b's) and the rows' bases (in every byte). high byte = sign << 7 | (base - depth) =
    base - code + 136 * sign, with code = 8 * sign + depth and 136 * sign = 17 * (code & 8). Each byte's result
    lies in 0..255, so the word's integer sum is the bytes side by side whatever borrows its terms make on the
    way: a mask, a subtraction, a multiply-add for 4 weights."""
    code = (codes >> (4 * A)) & 0x0F0F0F0F
    return (code & 0x08080808) * 17 + (base - code)


@triton.jit
def low_half(pair):
    """The first bf16 of an int32 pair (its low 16 bits), as fp32."""
    return (pair << 16).to(tl.float32, bitcast=True)


@triton.jit
def high_half(pair):
    """The second bf16 of an int32 pair, as fp32 (-65536 is 0xFFFF0000)."""
    return (pair & -65536).to(tl.float32, bitcast=True)


@triton.jit
def floor_value(top):
    """The floor an exception decodes to, as fp32, from its row's top 7 exponent bits: 2 ** (2 * (top - 7) - 127)
    (the bf16 bits (top - 7) << 8 widened; bf16 and fp32 share the bias), 0 for an all-zero row (top = 7). A
    power of two: floor * x is exact."""
    return ((top - 7) << 24).to(tl.float32, bitcast=True)


@triton.jit
def packed_row_dots(tiles, base, xs, USE_ASM: tl.constexpr):
    """[BLOCK_N] fp32: each row of the packed tiles against x (per tile, a tuple of its 8 planes' [BLOCK_N, G] or
    [1, G] fp32 slices). base: [BLOCK_N] int32, the rows' top exponent bits in every byte."""
    acc = tl.zeros(tiles[0][0].shape, dtype=tl.float32)
    for t in tl.static_range(len(tiles)):
        for a in tl.static_range(2):
            hi = high_bytes(tiles[t][2], base[:, None], a)  # [BLOCK_N, G]
            for p in tl.static_range(2):
                pair = bf16_pair(tiles[t][a], hi, p, USE_ASM)
                acc += low_half(pair) * xs[t][4 * a + 2 * p]  # two statements: two FFMAs
                acc += high_half(pair) * xs[t][4 * a + 2 * p + 1]
    return tl.sum(acc, axis=1)


@triton.jit
def exception_dots(exceptions, base, x_ptr, norm_ptr, HAS_NORM: tl.constexpr):
    """[BLOCK_N] fp32, what the decoded rows miss: over each row's exceptions, true weight * x[col] less the
    row's floor * x[col] (a power of two: that product is exact, so the row's sum is the bf16 row's up to the
    rounding of its products)."""
    col, value = exceptions
    ok = col >= 0
    xc = tl.load(x_ptr + col, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        xc *= tl.load(norm_ptr + col, mask=ok, other=0.0).to(tl.float32)
    floor = floor_value(base & 0x7F)
    return tl.sum(value * xc, axis=1) - floor * tl.sum(xc, axis=1)


@triton.jit
def plane_slices(x_ptr, norm_ptr, groups, rows, eps, K: tl.constexpr, TILE_K: tl.constexpr,
                 HAS_NORM: tl.constexpr, X_2D: tl.constexpr):  # fmt: skip
    """x * g as a tuple per tile of its 8 planes' fp32 slices, and the norm's rstd (1 without a norm).

    X_2D: each slice [BLOCK_N, G] with every row the same, loaded in the weight tiles' own layout, so that no
    slice crosses threads through shared memory (a thread holds, loads and scales a copy per row it owns).
    Otherwise [G], which the products broadcast over the rows: one copy a thread, moved into the tiles' layout
    through shared memory once a program."""
    G: tl.constexpr = TILE_K // 8
    offs = groups[None, :] + (rows * 0)[:, None] if X_2D else groups  # [BLOCK_N, G] or [G]
    xs = ()
    sumsq = tl.zeros([TILE_K], dtype=tl.float32)
    for t in tl.static_range(K // TILE_K):
        planes = ()
        for j in tl.static_range(8):
            xj = tl.load(x_ptr + t * TILE_K + j * G + offs).to(tl.float32)
            if HAS_NORM:
                xj *= tl.load(norm_ptr + t * TILE_K + j * G + offs).to(tl.float32)
            planes = planes + (xj if X_2D else xj[None, :],)
        xs = xs + (planes,)
        if HAS_NORM:
            xt = tl.load(x_ptr + t * TILE_K + tl.arange(0, TILE_K)).to(tl.float32)
            sumsq += xt * xt
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps) if HAS_NORM else tl.full([], 1.0, tl.float32)
    return xs, rstd


@triton.jit
def _packed_gemv_kernel(
    x_ptr,
    norm_ptr,
    out_ptr,
    lo_ptr,
    code_ptr,
    base_ptr,
    exc_col_ptr,
    exc_value_ptr,
    lo_up_ptr,
    code_up_ptr,
    base_up_ptr,
    exc_up_col_ptr,
    exc_up_value_ptr,
    N,
    eps,
    K: tl.constexpr,
    TILE_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXC: tl.constexpr,
    EXC_UP: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GATED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    X_2D: tl.constexpr,
    USE_PDL: tl.constexpr,
    TRIGGER_EARLY: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    TILES: tl.constexpr = K // TILE_K
    groups = tl.arange(0, TILE_K // 8)
    rows = tl.program_id(0) * ROW_BLOCKS * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if USE_PDL and TRIGGER_EARLY:
        gdc_launch_dependents()
    # The weights do not depend on the previous kernel: the first PREFETCH tiles are in flight before its wait,
    # with the rows' static data (their bases and exceptions).
    w = packed_tiles(lo_ptr, code_ptr, rows, row_ok, groups, K, TILE_K, 0, PREFETCH)
    u = packed_tiles(lo_up_ptr, code_up_ptr, rows, row_ok, groups, K, TILE_K, 0, PREFETCH if GATED else 0)
    base, exc = row_statics(base_ptr, exc_col_ptr, exc_value_ptr, rows, row_ok, EXC)
    base_up, exc_up = base, exc
    if GATED:
        base_up, exc_up = row_statics(base_up_ptr, exc_up_col_ptr, exc_up_value_ptr, rows, row_ok, EXC_UP)
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()
    w = w + packed_tiles(lo_ptr, code_ptr, rows, row_ok, groups, K, TILE_K, PREFETCH, TILES - PREFETCH)
    u = u + packed_tiles(
        lo_up_ptr, code_up_ptr, rows, row_ok, groups, K, TILE_K, PREFETCH, TILES - PREFETCH if GATED else 0
    )
    xs, rstd = plane_slices(x_ptr, norm_ptr, groups, rows, eps, K, TILE_K, HAS_NORM, X_2D)

    # ROW_BLOCKS blocks of BLOCK_N rows one after another, the next block's tiles in flight while this one's are
    # summed; x is read once a program.
    for j in tl.static_range(ROW_BLOCKS):
        if j + 1 < ROW_BLOCKS:
            next_rows = rows + BLOCK_N
            next_ok = next_rows < N
            next_w = packed_tiles(lo_ptr, code_ptr, next_rows, next_ok, groups, K, TILE_K, 0, TILES)
            next_u = packed_tiles(lo_up_ptr, code_up_ptr, next_rows, next_ok, groups, K, TILE_K, 0,
                                  TILES if GATED else 0)  # fmt: skip
            next_base, next_exc = row_statics(base_ptr, exc_col_ptr, exc_value_ptr, next_rows, next_ok, EXC)
            next_base_up, next_exc_up = next_base, next_exc
            if GATED:
                next_base_up, next_exc_up = row_statics(base_up_ptr, exc_up_col_ptr, exc_up_value_ptr, next_rows,
                                                        next_ok, EXC_UP)  # fmt: skip
        # the exceptions' x gathers go out first, with x's own loads, and are summed after the products
        y = exception_dots(exc, base, x_ptr, norm_ptr, HAS_NORM)
        if GATED:
            up = exception_dots(exc_up, base_up, x_ptr, norm_ptr, HAS_NORM)
        y = (y + packed_row_dots(w, base, xs, USE_ASM)) * rstd
        if GATED:
            up = (up + packed_row_dots(u, base_up, xs, USE_ASM)) * rstd
            y = y * tl.sigmoid(y) * up
        if ACCUMULATE:  # the residual stream: out is fp32 and takes the product
            y += tl.load(out_ptr + rows, mask=row_ok, other=0.0)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)
        if j + 1 < ROW_BLOCKS:
            rows, row_ok, w, u = next_rows, next_ok, next_w, next_u
            base, exc, base_up, exc_up = next_base, next_exc, next_base_up, next_exc_up


def _pick_block_n(n: int, device: torch.device) -> int:
    if interpreted():
        return min(16, triton.next_power_of_2(n))
    block_n = 8
    while block_n > 1 and triton.cdiv(n, block_n) < 4 * sm_count(device):
        block_n //= 2
    return block_n


def packed_gemv(
    x: torch.Tensor,
    weight: PackedWeight,
    out: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_up: PackedWeight | None = None,
    accumulate: bool = False,
    use_pdl: bool = False,
    trigger_early: bool = False,
    prefetch: int = 1,
    row_blocks: int = 1,
    x_2d: bool = True,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """out = W @ (rmsnorm(x) * norm_weight), or silu(W @ h) * (W_up @ h) with weight_up; with accumulate,
    out (fp32) += W @ x instead of being overwritten.

    x: [K] (any float dtype); out: [N]; norm_weight: [K] or None (no norm); prefetch: tiles a program loads
    before it waits for x; row_blocks: blocks of block_n rows a program takes in turn, the next one's tiles in
    flight while it sums the current one.
    """
    n, k = weight.shape
    if x.shape != (k,) or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [{k}], got {tuple(x.shape)}")
    if out.shape != (n,) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{n}], got {tuple(out.shape)}")
    if accumulate and (out.dtype != torch.float32 or weight_up is not None):
        raise ValueError("accumulate: needs an fp32 out and no weight_up")
    if weight_up is not None and (weight_up.shape != weight.shape or weight_up.tile_k != weight.tile_k):
        raise ValueError(f"weight_up: expected {weight.shape} packed like weight, got {weight_up.shape}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight: expected [{k}], got {tuple(norm_weight.shape)}")
    up = weight_up or weight
    block_n = block_n or _pick_block_n(n, x.device)
    tiles = k // weight.tile_k
    if row_blocks < 1:
        raise ValueError(f"row_blocks: expected at least 1, got {row_blocks}")
    _packed_gemv_kernel[(triton.cdiv(n, block_n * row_blocks),)](
        x,
        norm_weight if norm_weight is not None else x,
        out,
        weight.lo,
        weight.codes,
        weight.base,
        weight.exc_col,
        weight.exc_value,
        up.lo,
        up.codes,
        up.base,
        up.exc_col,
        up.exc_value,
        n,
        eps,
        K=k,
        TILE_K=weight.tile_k,
        BLOCK_N=block_n,
        EXC=weight.exc_col.shape[1],
        EXC_UP=up.exc_col.shape[1],
        HAS_NORM=norm_weight is not None,
        GATED=weight_up is not None,
        ACCUMULATE=accumulate,
        PREFETCH=max(1, min(prefetch, tiles)),
        ROW_BLOCKS=row_blocks,
        X_2D=x_2d,
        USE_PDL=use_pdl,
        TRIGGER_EARLY=trigger_early,
        USE_ASM=not interpreted(),
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    return out
