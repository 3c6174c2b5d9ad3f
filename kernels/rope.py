"""RoPE's pairing of head dims, shared by the kernels that rotate q and k (decode attention, the prefill
cache write and attention)."""

import triton
import triton.language as tl


@triton.jit
def rope_pairing(d, HD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For head dims d: the dim each rotates with, the index of their (cos, sin) pair, and whether d is the
    first of the two. Interleaved pairs (2i, 2i + 1), or rotate-half (i, i + HD/2)."""
    if INTERLEAVED:
        return d ^ 1, d // 2, d % 2 == 0
    else:
        half = d < HD // 2
        return tl.where(half, d + HD // 2, d - HD // 2), tl.where(half, d, d - HD // 2), half
