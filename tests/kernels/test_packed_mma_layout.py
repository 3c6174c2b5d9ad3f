"""The bookkeeping of kernels/packed_mma_gemv.py's tensor-core layout, on the CPU: reading the packed words back
the way the kernel's lanes do, one weight at a time (fragment rows and columns, chunk order, code nibbles, bases),
gives the matrix with its exceptions at their row's floor, which the kernel's mma see before it adds the exceptions'
corrections."""

import pytest
import torch

from kernels.packed_gemv import encode_rows, row_floors
from kernels.packed_mma_gemv import chunk_columns, fragment_index, pack_mma


def pack_floored(weight: torch.Tensor, normed: bool = False) -> dict:
    """pack_mma's words and bases, and the matrix they decode to on their own: every exception at its row's floor."""
    packed = pack_mma(weight, normed=normed)
    bits, _, _, base, exception = encode_rows(weight)
    decoded = torch.where(exception, row_floors(base)[:, None], bits)
    return {"lo": packed.lo, "codes": packed.codes, "base": packed.base, "n": packed.n, "k": packed.k,
            "decoded": decoded.to(torch.int16).view(torch.bfloat16)}  # fmt: skip


def read_back(packed: dict, normed: bool) -> torch.Tensor:
    """The bf16 [N, K] matrix the kernel's mma see: lane l's A fragment of M-tile m, K-part kp, from word
    c = 4 l + kp % 4 of chunk kp // 4 (low bytes of two words, hi bytes from the codes and the row bases)."""
    n, k = packed["n"], packed["k"]
    rows, cols = fragment_index("cpu")
    lo = packed["lo"].to(torch.int64) & 0xFFFFFFFF  # [m, chunk, a, c]
    codes = packed["codes"].to(torch.int64) & 0xFFFFFFFF  # [m, chunk, c]
    base = packed["base"].to(torch.int64) & 0xFFFFFFFF  # [m, g]: rows g, g in bytes 0-1, rows g + 8 in 2-3
    out = torch.zeros(n, k, dtype=torch.int64)
    order = chunk_columns(k, "cpu", normed)
    for m in range(n // 16):
        for kp in range(k // 16):
            chunk, slot = kp // 4, kp % 4
            for lane in range(32):
                c = 4 * lane + slot
                for a in range(2):
                    for b in range(4):
                        low = (lo[m, chunk, a, c] >> (8 * b)) & 0xFF
                        code = (codes[m, chunk, c] >> (4 * (2 * b + a))) & 0xF
                        row_base = (base[m, lane // 4] >> (8 * b)) & 0x7F
                        top = (code >> 3) << 7 | (row_base - (code & 7))
                        row = 16 * m + int(rows[a, b, lane])
                        out[row, order[16 * kp + int(cols[a, b, lane])]] = top << 8 | low
    return out.to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("normed", [False, True])
def test_the_lanes_read_back_the_matrix(normed):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 128, generator=gen) * 128**-0.5).to(torch.bfloat16)
    w[3, 5] = 1e-12  # an exception: decoded to its row's floor before its correction
    packed = pack_floored(w, normed=normed)
    assert torch.equal(read_back(packed, normed).view(torch.int16), packed["decoded"].view(torch.int16))
    assert packed["decoded"][3, 5] != w[3, 5]
    keep = torch.ones_like(w, dtype=torch.bool)
    keep[3, 5] = False
    assert torch.equal(packed["decoded"][keep].view(torch.int16), w[keep].view(torch.int16))


def test_chunk_columns_is_a_permutation_within_each_chunk():
    for normed in (False, True):
        order = chunk_columns(256, "cpu", normed)
        assert sorted(order.tolist()) == list(range(256))
        assert all(
            set(order[64 * i : 64 * (i + 1)].tolist()) == set(range(64 * i, 64 * (i + 1))) for i in range(4)
        )
