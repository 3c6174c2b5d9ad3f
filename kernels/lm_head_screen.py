"""The greedy head through an int8 screen: the same token as lm_head's argmax, reading half the bytes.

Greedy decode needs one number from the head, the index of the largest logit. Every row of the bf16 head
W [V, K] is kept a second time as int8 with a scale per row, W = s * Q + E, and the norms of each row's parts are
computed once when the copy is made. With x the normed input and x = sx * X + e its own rounding to integers:

    W x = s * sx * (Q . X)  +  s * (Q . e)  +  E . x
          ^ exact integers     |.| <= s*|Q|*|e|   |.| <= |E|*|x|      (Cauchy-Schwarz)

X is split into two int8 parts (X = 128 * hi + lo) packed four to a word, so Q . X is two dp4a a word of weights
(4 multiply-adds each, exact in int32), and a thread holds 4 x values a register where fp32 x took 1.

so one pass over the int8 copy gives every row an interval [lo, hi] that holds its exact logit (a margin covers
fp32 summation in any order). The row with the largest exact logit has hi >= L = max(lo), so only the rows with
hi >= L (the candidates) are read again in bf16 and compared exactly. On a model's real head these are a few
rows; on any input the answer is lm_head's (ties: the first index), and when the screen is loose (x with a huge
norm, weights the int8 copy fits badly) more rows are read again, never a wrong one.

Two launches, for the greedy token (screened_argmax) or for a sampled step's logits (screened_logits):
    _screen_kernel    the int8 pass: hi [V] (fp32; -inf past vocab_limit) and each program's max(lo)
    _rescore_kernel   L = max of those; each program compacts the candidates of its slice of rows, reads them in
                      bf16, and the grid's best goes through lm_head's publish_best (token, out_tokens, pos, ring);
                      or (LOGITS) it writes their logits, and -inf at the rows no draw can reach, for
                      kernels/sample.py, and may tell the host how many rows it read again (the runner leaves the
                      screen for requests whose logits are flat)

Bytes: V * K (int8) + 12 V (scale, norms) + 8 V (hi written and read) + the candidates' rows, against lm_head's
2 V * K: llama-3.2-1b's head is 263 MB instead of 525.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs
from kernels.lm_head import MAX_GROUPS, NO_ROW, HeadScratch, first_row_block, publish_best
from kernels.rmsnorm_gemv import next_row_block, normed_x_tiles, row_dots, weight_tiles
from kernels.sample import penalised

# x is rounded to integers L of at most 127 * 128 + 63, kept as two int8 parts L = 128 * hi + lo (hi in
# [-127, 127], lo in [-64, 63]), so that each product of 4 weights by 4 x parts is one dp4a. Each part's sum stays
# far below 2^31 for any K (2048 * 127 * 127 = 33M).
X_LEVELS = 127 * 128 + 63
# Relative slack for fp32 sums of the exact logits in any order (K * 2^-24 is 1.2e-4 at K = 2048) and for the
# screen's own fp32 products.
FP32_SLACK = 4e-4
# The rows the sampled head leaves out weigh at most 2^-TAIL_BITS of the distribution together (screened_logits).
TAIL_BITS = 30
# The rescoring programs' tally of candidates (screened_logits' candidate_ring) is one int64: the programs arrived
# in its low TICKET_BITS bits, their candidates above them.
TICKET_BITS = 24
_DP4A = tl.constexpr("dp4a.s32.s32 $0, $1, $2, $3;")


@dataclass
class HeadScreen:
    """The int8 copy of a head W [V, K] and what bounds its error, per row: W = scale * q + E.

    q [V, K4] int8 (K4: K rounded up to 4, zeros past K, so that a row is whole int32 words); scale [V] fp32
    (max |W[v]| / 127); q_norm [V] = scale * |q[v]|; e_norm [V] = |E[v]| (fp32)."""

    q: torch.Tensor
    scale: torch.Tensor
    q_norm: torch.Tensor
    e_norm: torch.Tensor

    @classmethod
    @torch.no_grad()  # a head that is a Parameter would otherwise keep every row block's float64 temporaries
    def build(cls, weight: torch.Tensor, rows_at_a_time: int = 8192) -> "HeadScreen":
        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"weight: expected a contiguous [V, K] tensor, got {tuple(weight.shape)}")
        vocab, k = weight.shape
        device = weight.device
        q = torch.zeros(vocab, -(-k // 4) * 4, dtype=torch.int8, device=device)
        scale, q_norm, e_norm = (torch.empty(vocab, dtype=torch.float32, device=device) for _ in range(3))
        for start in range(0, vocab, rows_at_a_time):  # float64 of a few thousand rows at a time, not of W
            part = slice(start, start + rows_at_a_time)
            w = weight[part].double()
            s = w.abs().amax(dim=1) / 127
            s = torch.where(s > 0, s, torch.ones_like(s))
            rounded = torch.round(w / s[:, None]).clamp_(-127, 127)
            q[part, :k], scale[part] = rounded.to(torch.int8), s.float()
            # the norms rounded up a little, so that storing them in fp32 never makes a bound smaller
            q_norm[part] = (s * rounded.norm(dim=1) * (1 + 1e-6)).float()
            e_norm[part] = ((w - s[:, None] * rounded).norm(dim=1) * (1 + 1e-6)).float()
        return cls(q, scale, q_norm, e_norm)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.q_norm, self.e_norm))


class ScreenScratch:
    """hi [V], each screen program's max(lo), and lm_head's argmax scratch for the rescoring grid."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.hi = torch.empty(vocab_size, dtype=torch.float32, device=device)
        self.lo_max = torch.empty(vocab_size, dtype=torch.float32, device=device)
        self.screens = 0  # screen programs of the last launch: lo_max[:screens] is theirs
        self.head = HeadScratch(vocab_size, device)
        self.tally = torch.zeros(1, dtype=torch.int64, device=device)  # zero between launches

    def floor(self) -> torch.Tensor:
        """L of the last launch: the largest lower bound of any row (a 0-d tensor on the device)."""
        return self.lo_max[: self.screens].max()

    def candidates(self, rows: int) -> int:
        """How many of the first `rows` rows the last launch read again in bf16 (hi >= L); synchronizes."""
        return int((self.hi[:rows] >= self.floor()).sum())


@triton.jit
def packed_bytes(levels, BLOCK_W: tl.constexpr):
    """[4 * BLOCK_W] int32 values in [-128, 127] -> [BLOCK_W] int32 words of 4 bytes (element 4i + j in byte j of
    word i, as the int8 weights lie in memory)."""
    quads = tl.reshape(levels, [BLOCK_W, 4]).to(tl.uint32) & 255
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    return tl.sum(quads << shifts[None, :], axis=1).to(tl.int32, bitcast=True)


@triton.jit
def x_parts(xs, BLOCK_K: tl.constexpr, X_LEVELS: tl.constexpr):
    """x (a tuple of [BLOCK_K] fp32 tiles) rounded to integers L = 128 * hi + lo of at most X_LEVELS: (hi words,
    lo words (tuples of [BLOCK_K / 4] int32, 4 bytes each), the step sx, |x|, |x - sx * L|)."""
    amax = tl.max(tl.abs(xs[0]), axis=0)
    for i in tl.static_range(1, len(xs)):
        amax = tl.maximum(amax, tl.max(tl.abs(xs[i]), axis=0))
    sx = tl.where(amax > 0, amax / X_LEVELS, 1.0)
    his = ()
    los = ()
    x_sq = tl.zeros_like(xs[0])
    err_sq = tl.zeros_like(xs[0])
    for i in tl.static_range(len(xs)):
        level = tl.floor(xs[i] / sx + 0.5)
        err = xs[i] - level * sx
        x_sq += xs[i] * xs[i]
        err_sq += err * err
        hi = tl.floor((level + 64.0) / 128.0)
        his = his + (packed_bytes(hi.to(tl.int32), BLOCK_K // 4),)
        los = los + (packed_bytes((level - 128.0 * hi).to(tl.int32), BLOCK_K // 4),)
    return his, los, sx, tl.sqrt(tl.sum(x_sq, axis=0)), tl.sqrt(tl.sum(err_sq, axis=0))


@triton.jit
def dot4(w, x, acc, USE_ASM: tl.constexpr):
    """acc + the dot product of the 4 signed bytes of w with those of x, elementwise over int32 tensors: one dp4a
    on the GPU; byte by byte (arithmetic shifts) under the interpreter, which runs no inline asm. Exact in both."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_DP4A, "=r,r,r,r", [w, x, acc], dtype=tl.int32, is_pure=True, pack=1)
    for j in tl.static_range(4):
        acc += ((w << (24 - 8 * j)) >> 24) * ((x << (24 - 8 * j)) >> 24)
    return acc


@triton.jit
def int_row_dots(tiles, his, los, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, USE_ASM: tl.constexpr):
    """[BLOCK_N] fp32: each row of the int8 weight tiles (tuples of [BLOCK_N, BLOCK_W] int32 words) against
    x = 128 * hi + lo; both parts' sums are exact in int32, the combination is one fp32 rounding."""
    acc_hi = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    acc_lo = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for i in tl.static_range(len(tiles)):
        acc_hi = dot4(tiles[i], tl.broadcast_to(his[i][None, :], [BLOCK_N, BLOCK_W]), acc_hi, USE_ASM)
        acc_lo = dot4(tiles[i], tl.broadcast_to(los[i][None, :], [BLOCK_N, BLOCK_W]), acc_lo, USE_ASM)
    return 128.0 * tl.sum(acc_hi, axis=1).to(tl.float32) + tl.sum(acc_lo, axis=1).to(tl.float32)


@triton.jit
def _screen_kernel(
    x_ptr,
    norm_ptr,
    q_ptr,
    scale_ptr,
    q_norm_ptr,
    e_norm_ptr,
    hi_ptr,
    lo_max_ptr,
    V,
    vocab_limit,
    eps,
    K: tl.constexpr,
    K_WORDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    X_LEVELS: tl.constexpr,
    FP32_SLACK: tl.constexpr,
    USE_ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # The int8 rows are read as int32 words: [BLOCK_N, BLOCK_W] a tile, 4 weights a word.
    BLOCK_W: tl.constexpr = BLOCK_K // 4
    TILES: tl.constexpr = (K_WORDS + BLOCK_W - 1) // BLOCK_W
    pid = tl.program_id(0)
    rows, row_ok, w_offs, w = first_row_block(q_ptr, V, K_WORDS, BLOCK_N, BLOCK_W, ROW_BLOCKS, USE_PDL)
    words = tl.arange(0, BLOCK_W)

    # x * g by tiles and rstd (the norm's scalar multiplies the products, the bounds and the exact logits alike)
    xs, rstd = normed_x_tiles(x_ptr, norm_ptr, tl.arange(0, BLOCK_K), eps, K, BLOCK_K, HAS_NORM)
    his, los, sx, x_norm, err_norm = x_parts(xs, BLOCK_K, X_LEVELS)

    lo_best = tl.full([], float("-inf"), tl.float32)
    for j in tl.static_range(ROW_BLOCKS):
        if j + 1 < ROW_BLOCKS:
            next_rows, next_ok, next_offs = next_row_block(rows, w_offs, V, BLOCK_N, K_WORDS)
            next_w = weight_tiles(q_ptr, next_offs, next_ok, words, K_WORDS, BLOCK_W, 0, TILES)
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        q_norm = tl.load(q_norm_ptr + rows, mask=row_ok, other=0.0)
        e_norm = tl.load(e_norm_ptr + rows, mask=row_ok, other=0.0)
        approx = int_row_dots(w, his, los, BLOCK_N, BLOCK_W, USE_ASM) * (scale * sx)  # [BLOCK_N]
        bound = q_norm * err_norm + e_norm * x_norm + FP32_SLACK * (q_norm + e_norm) * (x_norm + err_norm)
        chosen = rows < vocab_limit
        hi = tl.where(chosen, (approx + bound) * rstd, float("-inf"))
        lo = tl.where(chosen, (approx - bound) * rstd, float("-inf"))
        tl.store(hi_ptr + rows, hi, mask=row_ok)
        lo_best = tl.maximum(lo_best, tl.max(lo, axis=0))
        if j + 1 < ROW_BLOCKS:
            rows, row_ok, w_offs, w = next_rows, next_ok, next_offs, next_w
    tl.store(lo_max_ptr + pid, lo_best)


@triton.jit
def _rescore_kernel(
    x_ptr,
    norm_ptr,
    w_ptr,
    hi_ptr,
    lo_max_ptr,
    logits_ptr,
    seen_ptr,
    params_ptr,
    tally_ptr,
    best_val_ptr,
    best_idx_ptr,
    counter_ptr,
    token_ptr,
    pos_ptr,
    out_tokens_ptr,
    ring_ptr,
    V,
    screens,
    eps,
    tail_nats,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLICE: tl.constexpr,
    CAP: tl.constexpr,
    SCREENS: tl.constexpr,
    GROUP: tl.constexpr,
    MAX_GROUPS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    LOGITS: tl.constexpr,
    RING: tl.constexpr,
    TICKET_BITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # ring_ptr [RING]: the host's ring of tokens (greedy), or of candidate counts (LOGITS); RING = 0: none
    TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    pid = tl.program_id(0)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    # L = the largest lower bound of the whole head (the screen programs' maxima)
    screen_ids = tl.arange(0, SCREENS)
    lo_max = tl.load(lo_max_ptr + screen_ids, mask=screen_ids < screens, other=float("-inf"))
    floor = tl.max(lo_max, axis=0)
    slice_rows = pid * SLICE + tl.arange(0, SLICE)
    in_vocab = slice_rows < V
    hi = tl.load(hi_ptr + slice_rows, mask=in_vocab, other=float("-inf"))
    if LOGITS:
        # Bounds of the sampler's logits l', penalised where seen (the penalty f is increasing in l): a row's
        # upper bound f(hi); and the row of the largest lower bound L has l' >= f(L) if seen, >= L if not, so
        # max l' >= min(L, f(L)) (exactly L without a penalty) ...
        penalty = tl.load(params_ptr + 3)
        hi = penalised(hi, tl.load(seen_ptr + slice_rows, mask=in_vocab, other=0).to(tl.int1), penalty)
        floor = tl.minimum(floor, penalised(floor, True, penalty))
        # ... and every row whose weight exp(l' / T) may reach 2^-TAIL_BITS / V of the largest row's is read
        temperature = tl.load(params_ptr)
        floor -= tl.where(temperature > 0, temperature * tail_nats, 0.0)
    is_candidate = hi >= floor
    if LOGITS:  # the rows left out weigh nothing in the sampler (disjoint from the candidates' stores below)
        tl.store(logits_ptr + slice_rows, float("-inf"), mask=in_vocab & ~is_candidate)
    count = tl.sum(is_candidate.to(tl.int32), axis=0)
    if LOGITS and RING > 0:
        # The step's candidates for the host (FastRunner leaves the screen when they are most of the vocabulary):
        # one atomic a program carries its arrival and its count; the last to arrive writes the sum at the step's
        # slot of the ring, as the sampler does its token, and zeroes the tally. Issued here, its round trip
        # overlaps the rows' reads.
        ticket: tl.constexpr = 1 << TICKET_BITS
        old = tl.atomic_add(tally_ptr, count.to(tl.int64) * ticket + 1, sem="relaxed", scope="gpu")
        if old % ticket == tl.num_programs(0) - 1:
            tl.atomic_xchg(tally_ptr, 0, sem="relaxed", scope="gpu")
            slot = (tl.load(pos_ptr) + 1) % RING
            tl.store(ring_ptr + slot, (old // ticket + count).to(ring_ptr.dtype.element_ty))
    rank = tl.cumsum(is_candidate.to(tl.int32), axis=0) - 1  # [SLICE]: a candidate's place among its slice's
    xs, rstd = normed_x_tiles(x_ptr, norm_ptr, tl.arange(0, BLOCK_K), eps, K, BLOCK_K, HAS_NORM)

    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.full([], NO_ROW, tl.int32)
    slots = tl.arange(0, CAP)
    cols = tl.arange(0, BLOCK_K)
    # CAP candidates at a time, in increasing row order (nearly always one round, or none)
    start = 0
    while start < count:
        wanted = start + slots  # [CAP]
        picks = (rank[None, :] == wanted[:, None]) & is_candidate[None, :]  # [CAP, SLICE]
        rows = tl.sum(tl.where(picks, slice_rows[None, :], 0), axis=1)  # [CAP]
        row_ok = wanted < count
        w_offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
        w = weight_tiles(w_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, TILES)
        logits = tl.where(row_ok, row_dots(w, xs, CAP, BLOCK_K) * rstd, float("-inf"))
        if LOGITS:
            tl.store(logits_ptr + rows, logits, mask=row_ok)
        else:
            top = tl.max(logits, axis=0)
            top_at = tl.min(tl.where(logits == top, rows, NO_ROW), axis=0)
            take = top > best
            best, best_at = tl.where(take, top, best), tl.where(take, top_at, best_at)
        start += CAP
    if not LOGITS:
        publish_best(best, best_at, best_val_ptr, best_idx_ptr, counter_ptr, token_ptr, pos_ptr, out_tokens_ptr,
                     ring_ptr, GROUP, MAX_GROUPS, RING)  # fmt: skip


def _pick_blocks(k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, row_blocks, num_warps) of the screen pass."""
    block_k = max(16, min(512, triton.next_power_of_2(k)))  # whole int32 words of int8 a tile
    if interpreted():  # programs run one after another there: few, large ones
        return 64, min(128, block_k), 1, 4
    # lm_head's bytes in flight (two blocks of 4 bf16 rows of 2048) as int8: 8 rows a block
    block_n = 8
    while block_n > 1 and block_n * k > 16384:
        block_n //= 2
    return block_n, block_k, 4, 4


def screened_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    screen: HeadScreen,
    scratch: ScreenScratch,
    *,
    token: torch.Tensor,
    pos: torch.Tensor,
    out_tokens: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    vocab_limit: int | None = None,
    host_ring: torch.Tensor | None = None,
    use_pdl: bool = False,
    slice_rows: int | None = None,
    cap: int = 8,
    group: int | None = None,
    block_n: int | None = None,
    row_blocks: int | None = None,
    num_warps: int | None = None,
) -> None:
    """lm_head's greedy contract without the logits: token[0] = argmax over the first vocab_limit rows of
    weight @ (rmsnorm(x) * norm_weight) (first on ties), out_tokens[pos[0] + 1] = token[0], pos[0] += 1, and
    host_ring[(pos[0] + 1) % R] = token[0] when given.

    x: [K]; weight: [V, K] (the bf16 head, read again for the candidates); screen: HeadScreen.build(weight);
    scratch: ScreenScratch(V, device). slice_rows: rows a rescoring program looks at (a power of two; None: 512,
    64 under the interpreter); cap: candidates it reads at a time; group: rescoring programs a first-level group
    of the argmax (None: all of them, one level); block_n, row_blocks, num_warps: the screen pass's rows a block,
    blocks a program and warps (None: _pick_blocks)."""
    for name, t in (("token", token), ("pos", pos), ("out_tokens", out_tokens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an int32/int64 tensor, got {t.dtype}")
    if token.numel() != 1 or pos.numel() != 1:
        raise ValueError("token: token and pos must hold one element each")
    head = scratch.head
    launch = _ScreenLaunch(x, weight, screen, scratch, norm_weight, eps, vocab_limit, use_pdl, slice_rows, cap,
                           block_n, row_blocks, num_warps)  # fmt: skip
    launch.screen()
    group = group or min(MAX_GROUPS, triton.next_power_of_2(launch.programs))
    if triton.cdiv(launch.programs, group) > MAX_GROUPS or group & (group - 1):
        raise ValueError(f"group: a power of two, at most {MAX_GROUPS} groups of {launch.programs} programs")
    launch.rescore(
        logits=head.counter, seen=head.counter, params=head.counter, tail_nats=0.0, token=token, pos=pos,
        out_tokens=out_tokens, ring=host_ring if host_ring is not None else head.counter, group=group,
        RING=host_ring.numel() if host_ring is not None else 0, LOGITS=False,
    )  # fmt: skip


def screened_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    screen: HeadScreen,
    scratch: ScreenScratch,
    logits: torch.Tensor,
    *,
    seen: torch.Tensor,
    params: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    vocab_limit: int | None = None,
    candidate_ring: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
    use_pdl: bool = False,
    slice_rows: int | None = None,
    cap: int = 8,
    block_n: int | None = None,
    row_blocks: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The logits kernels/sample.py draws from, through the screen: lm_head's logits (the same fp32 values) at
    every row that can weigh in the draw, -inf at the rest.

    With T = params[0] (the temperature) and f the repetition penalty r = params[3] on rows where seen is set, a
    row is computed when f(its upper bound) reaches F - T * (ln V + TAIL_BITS ln 2), with L the largest lower bound
    and F = min(L, f(L)) (L without a penalty), a lower bound of the largest penalised logit. A row left out has a
    sampling weight exp(l' / T) below 2^-TAIL_BITS / V of the largest row's, so all of them together weigh under
    2^-TAIL_BITS (1e-9) of the distribution, below the resolution of the sampler's fp32 sums, and the draw (the
    Gumbel-max race over the same logits and noise) is the whole head's except with at most that probability.
    At T = 0 (greedy with a penalty) the argmax is exact. The higher the temperature the more rows are read
    again: on models/default 12 of 8,192 a step at 0.2 (median), 1,309 at 0.5, nearly all at 0.7, where the whole
    bf16 head (lm_head) is cheaper, as it is on flat logits at any temperature; which to use is the caller's choice
    (FastRunner.uses_screen by the temperature, then inference/fast/head_choice.py by the counts candidate_ring
    returns).

    logits: [V] fp32; seen: [V] bool; params: fp32 [4] as kernels/sample.py's (temperature, top_k, top_p,
    penalty); candidate_ring: an int32 tensor [R] (pinned host memory on a GPU) that receives the number of rows
    read again at candidate_ring[(pos[0] + 1) % R], the slot of the token the step draws (pos: the position before
    the step, as the sampler reads it); the rest as screened_argmax."""
    if logits.shape != (weight.shape[0],) or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits: expected a contiguous fp32 [{weight.shape[0]}], got {logits.dtype} "
                         f"{tuple(logits.shape)}")  # fmt: skip
    if seen.shape != logits.shape or seen.dtype != torch.bool:
        raise ValueError(f"seen: expected a bool [{logits.numel()}], got {seen.dtype} {tuple(seen.shape)}")
    if params.numel() < 4 or params.dtype != torch.float32:
        raise ValueError(f"params: expected fp32 (temperature, top_k, top_p, penalty), got {params.dtype} "
                         f"{tuple(params.shape)}")  # fmt: skip
    if candidate_ring is not None and (
        candidate_ring.dtype != torch.int32 or candidate_ring.dim() != 1 or pos is None or pos.numel() != 1
        or pos.dtype not in (torch.int32, torch.int64)
    ):  # fmt: skip
        raise ValueError("candidate_ring: expected an int32 [R] ring and pos, one int32/int64 element")
    launch = _ScreenLaunch(x, weight, screen, scratch, norm_weight, eps, vocab_limit, use_pdl, slice_rows, cap,
                           block_n, row_blocks, num_warps)  # fmt: skip
    if candidate_ring is not None and launch.programs >= 1 << TICKET_BITS:
        raise ValueError(f"candidate_ring: {launch.programs} rescoring programs, the tally counts under "
                         f"{1 << TICKET_BITS}")  # fmt: skip
    launch.screen()
    counter = scratch.head.counter  # unused pointers of the argmax (and of the tally without a ring)
    ring, pos, ring_size = (candidate_ring, pos, candidate_ring.numel()) if candidate_ring is not None else (
        counter, counter, 0)  # fmt: skip
    launch.rescore(
        logits=logits, seen=seen, params=params, tail_nats=math.log(weight.shape[0]) + TAIL_BITS * math.log(2),
        token=counter, pos=pos, out_tokens=counter, ring=ring, group=1, RING=ring_size, LOGITS=True,
    )  # fmt: skip
    return logits


class _ScreenLaunch:
    """The checks and launch arguments the two uses of the screen share: the screen pass, then the rescoring
    grid (slices of slice_rows rows)."""

    def __init__(self, x, weight, screen, scratch, norm_weight, eps, vocab_limit, use_pdl, slice_rows, cap,
                 block_n, row_blocks, num_warps):  # fmt: skip
        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"weight: expected a contiguous [V, K] tensor, got {tuple(weight.shape)}")
        vocab, k = weight.shape
        if screen.q.shape != (vocab, -(-k // 4) * 4) or screen.scale.shape != (vocab,):
            raise ValueError(f"screen: built for {tuple(screen.q.shape)}, the head is {(vocab, k)}")
        if x.shape != (k,) or not x.is_contiguous():
            raise ValueError(f"x: expected a contiguous [{k}], got {tuple(x.shape)}")
        if norm_weight is not None and norm_weight.shape != (k,):
            raise ValueError(f"norm_weight: expected [{k}], got {tuple(norm_weight.shape)}")
        if scratch.hi.numel() < vocab:
            raise ValueError(f"scratch: allocated for a vocabulary under {vocab}")
        self.slice_rows = slice_rows or (64 if interpreted() else 512)
        if self.slice_rows & (self.slice_rows - 1) or cap & (cap - 1):
            raise ValueError(f"slice_rows, cap: expected powers of two, got {self.slice_rows}, {cap}")
        auto_n, self.block_k, auto_blocks, auto_warps = _pick_blocks(k)
        self.block_n, self.row_blocks = block_n or auto_n, row_blocks or auto_blocks
        self.num_warps = num_warps or auto_warps
        self.screens = triton.cdiv(triton.cdiv(vocab, self.block_n), self.row_blocks)
        if self.screens > scratch.lo_max.numel():
            raise ValueError(f"scratch: {self.screens} screen programs, room for {scratch.lo_max.numel()}")
        self.programs = triton.cdiv(vocab, self.slice_rows)
        self.x, self.weight, self.screen_copy, self.scratch = x, weight, screen, scratch
        self.norm = norm_weight if norm_weight is not None else x
        self.has_norm, self.eps, self.cap, self.use_pdl = norm_weight is not None, eps, cap, use_pdl
        self.vocab_limit = min(vocab_limit or vocab, vocab)

    def screen(self) -> None:
        """The int8 pass: hi [V] and each program's max(lo)."""
        copy, scratch = self.screen_copy, self.scratch
        scratch.screens = self.screens  # how many of lo_max the launch fills (diagnostics read them)
        _screen_kernel[(self.screens,)](
            self.x, self.norm, copy.q.view(torch.int32), copy.scale, copy.q_norm, copy.e_norm, scratch.hi,
            scratch.lo_max, self.weight.shape[0], self.vocab_limit, self.eps,
            K=self.weight.shape[1], K_WORDS=copy.q.shape[1] // 4, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
            ROW_BLOCKS=self.row_blocks, HAS_NORM=self.has_norm, X_LEVELS=X_LEVELS,
            FP32_SLACK=FP32_SLACK, USE_ASM=not interpreted(), USE_PDL=self.use_pdl, num_warps=self.num_warps,
            **pdl_kwargs(self.use_pdl),
        )  # fmt: skip

    def rescore(self, *, logits, seen, params, tail_nats, token, pos, out_tokens, ring, group, RING, LOGITS):
        scratch, head = self.scratch, self.scratch.head
        _rescore_kernel[(self.programs,)](
            self.x, self.norm, self.weight, scratch.hi, scratch.lo_max, logits, seen, params, scratch.tally,
            head.best_val, head.best_idx, head.counter, token, pos, out_tokens, ring,
            self.weight.shape[0], self.screens, self.eps, tail_nats,
            K=self.weight.shape[1], BLOCK_K=self.block_k, SLICE=self.slice_rows, CAP=self.cap,
            SCREENS=triton.next_power_of_2(self.screens), GROUP=group, MAX_GROUPS=MAX_GROUPS,
            HAS_NORM=self.has_norm, LOGITS=LOGITS, RING=RING, TICKET_BITS=TICKET_BITS, USE_PDL=self.use_pdl,
            num_warps=4, **pdl_kwargs(self.use_pdl),
        )  # fmt: skip
