"""The lossless 12-bit form of a bf16 weight matrix that kernels/packed_mma_gemv.py reads, and the decode helpers
its kernel shares.

Why it can be exact: a bf16 number is a sign, 8 exponent bits and 7 mantissa bits, and within one row of a weight
matrix the exponents crowd below the row's largest. The low byte (the exponent's last bit and the mantissa) is
kept as it is; the high byte (the sign and the exponent's top 7 bits) becomes a 4-bit code, the sign and how far
the top 7 bits lie below the row's largest (0..7, i.e. 16 binades). A weight further down than that (under
~2**-14 of the row's largest, zeros included; ~1e-4 of a random matrix's weights) is an exception: its code
decodes to the window's floor with a zero low byte, and its true value is kept in a list beside the matrix: the
kernel adds true value * x and takes away floor * x (a power of two, so that product is exact), and every row's
sum is that of the bf16 row up to fp32 rounding (in another order, as any change of block shape gives).

A kernel decodes 4 weights a word with integer arithmetic on the whole word (each byte's result lies in 0..255, so
the word holds them side by side) and a byte permute that interleaves the low and high bytes into two bf16 numbers
(`prmt` on the GPU).
"""

import torch
import triton
import triton.language as tl

WINDOW = 7  # the deepest code: the top 7 exponent bits at most this far below the row's largest
# prmt(lo, hi) numbers lo's bytes 0-3 and hi's 4-7: bytes [L0, H0, L1, H1], and [L2, H2, L3, H3]
_PRMT_PAIR_0 = tl.constexpr("prmt.b32 $0, $1, $2, 0x5140;")
_PRMT_PAIR_1 = tl.constexpr("prmt.b32 $0, $1, $2, 0x7362;")


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
