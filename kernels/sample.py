"""The sampled step's token from the head's logits in two launches: repetition penalty, temperature, top-k,
top-p and the draw, then the step's bookkeeping, all on the device.

    l_v = logits[v] (-inf at v >= vocab_limit), penalised where seen[v] (l > 0: l / r, else l * r), / temperature
    kept = the top_k largest l (all when top_k = 0), then the smallest prefix of them, in descending order,
           whose probability (renormalised over the top_k) reaches top_p; the largest is always kept
    token ~ softmax(l) over `kept`, drawn as argmax_v l_v + Gumbel_v (the Gumbel-max trick)
    temperature 0 (greedy with a repetition penalty): token = argmax l_v, first index on ties

The Gumbel noise of token v in draw d at position p is a function of (seed, p, d, v) (Philox): launches agree
on it without sharing it, and a seed repeats its tokens.

Launch 1, `_sample_scan_kernel` (P programs, each a chunk of CHUNK logits): the chunk's maximum and softmax sum,
its C largest logits as int64 keys that sort like (value, -index), and, without a top_k, its best l + Gumbel.
Launch 2, `_sample_pick_kernel` (one program) has the exact softmax denominator from the P partial sums, and T,
the largest of the chunks' C-th candidates: every token with a key above T is a candidate. Then:
- top_k = 0 (the page's and the OpenAI API's case): the chunks' best is a draw from softmax(l) over the whole
  vocabulary. With top_p = 1 it is the token. Otherwise it is kept when the mass strictly above it is below top_p,
  or drawn again, with fresh noise, among the tokens above it, which hold the whole nucleus (rejection: the
  accepted draw is distributed as softmax(l) over the nucleus; a redraw happens with probability at most
  1 - top_p). Nothing is sorted: the mass above a token with key >= T is a masked sum over the candidates, and
  only a token below T costs a pass over the vocabulary.
- top_k > 0: the P * C candidates sorted; the kept prefix when it ends inside their exact prefix, otherwise
  the thresholds found by bisection over the keys, a pass over the vocabulary per probe (slow, exact; only
  for a top_k and a nucleus wider than the candidates' exact prefix).
Ties at a threshold are kept together where the sorted reference keeps the lower indices first.

`info` counts the steps by path (SAMPLE_PATHS) and the redraws, for tests and the benchmark.

Bytes: the logits (4 V) and the seen flags (V) once in launch 1, P * C candidates in launch 2.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs

# What info counts: steps by path (a nucleus settled from the candidates; nothing cut; passes over the
# vocabulary needed; greedy with a repetition penalty; a top_k settled from the sorted candidates), then redraws.
SAMPLE_PATHS = ("nucleus", "whole vocabulary", "vocabulary passes", "greedy", "top-k")
SAMPLE_INFO = (*SAMPLE_PATHS, "redraws")
_LOG2E = 1.4426950408889634
MAX_DRAWS = 64  # redraws of a step, at most (each draw shrinks the field strictly; the expected count is < 1)
_INDEX_MAX = 0x7FFFFFFF  # the low half of a packed key holds _INDEX_MAX - index: lower indices sort higher


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the floats' order (-inf lowest)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature):
    """l for the tokens at offs: -inf outside the vocabulary, the repetition penalty on seen tokens, then the
    temperature."""
    ok = offs < vocab_limit
    lg = tl.load(logits_ptr + offs, mask=ok, other=float("-inf"))
    seen = tl.load(seen_ptr + offs, mask=ok, other=0).to(tl.int1)
    lg = tl.where(seen, tl.where(lg > 0, lg / penalty, lg * penalty), lg)
    return lg * inv_temperature


@triton.jit
def _gumbel(step_seed, offs):
    """Gumbel(0, 1) noise of tokens offs at this step: -log(-log(u)), u uniform in [0, 1); u = 0 gives -inf
    (never drawn)."""
    u = tl.rand(step_seed, offs)
    return -tl.log(-tl.log(u))


@triton.jit
def _params(params_ptr):
    temperature = tl.load(params_ptr)
    top_k = tl.load(params_ptr + 1).to(tl.int32)
    top_p = tl.load(params_ptr + 2)
    penalty = tl.load(params_ptr + 3)
    inv_temperature = tl.where(temperature > 0, 1.0 / tl.maximum(temperature, 1e-30), 1.0)
    return temperature, top_k, top_p, penalty, inv_temperature


@triton.jit
def _draw_seed(seed_ptr, pos, draw):
    """The Philox seed of a step's draw number `draw` (0: the first, the scan's; 1, 2, ...: redraws)."""
    step_seed = tl.randint(tl.load(seed_ptr), pos)
    return tl.where(draw > 0, tl.randint(step_seed, draw + pos * 0), step_seed)  # (draw may be a Python int)


@triton.jit
def _sample_scan_kernel(
    logits_ptr,
    seen_ptr,
    params_ptr,
    seed_ptr,
    pos_ptr,
    cand_ptr,
    chunk_ml_ptr,
    race_val_ptr,
    race_idx_ptr,
    vocab_limit,
    CHUNK: tl.constexpr,
    C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if USE_PDL:  # everything below reads the head's logits or the previous step's bookkeeping
        gdc_wait()
        gdc_launch_dependents()
    temperature, top_k, top_p, penalty, inv_temperature = _params(params_ptr)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    lg = _scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature)  # [CHUNK]

    m = tl.max(lg, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk past the vocabulary
    tl.store(chunk_ml_ptr + 2 * pid, m)
    tl.store(chunk_ml_ptr + 2 * pid + 1, tl.sum(tl.exp2((lg - m_safe) * 1.4426950408889634), axis=0))

    # The C largest, as int64 keys (order key of l << 32 | INDEX_MAX - v): sorted, ties go to the lower index.
    packed = (_order_key(lg).to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    tl.store(cand_ptr + pid * C + tl.arange(0, C), tl.topk(packed, C))

    if (temperature > 0) & (top_k == 0):  # this chunk's part of the first draw, over the whole vocabulary
        score = lg + _gumbel(_draw_seed(seed_ptr, tl.load(pos_ptr), 0), offs)
        best = tl.max(score, axis=0)
        tl.store(race_val_ptr + pid, best)
        tl.store(race_idx_ptr + pid, tl.min(tl.where(score == best, offs, 0x7FFFFFFF), axis=0))


@triton.jit
def _count_and_mass(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, above, floor, m_all,
                    BLOCK: tl.constexpr):  # fmt: skip
    """Over the whole vocabulary: how many keys are >= above, and the softmax mass (unnormalised, relative to
    m_all) of the keys > above that are also >= floor."""
    count = tl.zeros([], dtype=tl.int32)
    mass = tl.zeros([], dtype=tl.float32)
    start = 0
    while start < vocab_limit:  # a while loop: the interpreter takes no tensor bound in range()
        offs = start + tl.arange(0, BLOCK)
        lg = _scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature)
        key = _order_key(lg)
        count += tl.sum((key >= above) & (offs < vocab_limit), axis=0).to(tl.int32)
        inside = (key > above) & (key >= floor)
        mass += tl.sum(tl.where(inside, tl.exp2((lg - m_all) * 1.4426950408889634), 0.0), axis=0)
        start += BLOCK
    return count, mass


@triton.jit
def _race_from(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, threshold, draw_seed,
               BLOCK: tl.constexpr):  # fmt: skip
    """One pass over the vocabulary: the draw (l + Gumbel, first index on ties) among the keys >= threshold."""
    best = tl.full([], float("-inf"), tl.float32)
    token = tl.zeros([], dtype=tl.int32)
    start = 0
    while start < vocab_limit:
        offs = start + tl.arange(0, BLOCK)
        lg = _scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature)
        inside = (_order_key(lg) >= threshold) & (offs < vocab_limit)
        score = tl.where(inside, lg + _gumbel(draw_seed, offs), float("-inf"))
        block_best = tl.max(score, axis=0)
        block_at = tl.min(tl.where(score == block_best, offs, 0x7FFFFFFF), axis=0)
        take = block_best > best
        best, token = tl.where(take, block_best, best), tl.where(take, block_at, token)
        start += BLOCK
    return token


@triton.jit
def _bisection_draw(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, top_k, top_p, m_all, z_all,
                    key_top, draw_seed, BLOCK: tl.constexpr):  # fmt: skip
    """The kept set as {v: key_v >= threshold}, found by bisection over the int32 keys, then the draw: exact
    for any nucleus and top_k, each probe one pass over the vocabulary."""
    key_min = tl.full([], -2147483647, tl.int32)
    # top_k: the largest key t with count(key >= t) >= top_k (all tokens when top_k = 0 or beyond them).
    floor = key_min
    if top_k > 0:
        lo, hi = key_min.to(tl.int64), key_top.to(tl.int64)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            count, _mass = _count_and_mass(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature,
                                           mid.to(tl.int32), key_min, m_all, BLOCK)  # fmt: skip
            if count >= top_k:
                lo = mid
            else:
                hi = mid - 1
        floor = lo.to(tl.int32)
    # The kept top_k's mass (z_all without a top_k), then top_p: the smallest t >= floor whose mass strictly
    # above is below top_p of it; a key is kept when key >= t.
    z_kept = z_all
    if top_k > 0:
        _count, z_kept = _count_and_mass(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature,
                                         floor - 1, floor, m_all, BLOCK)  # fmt: skip
    threshold = floor
    if top_p < 1.0:
        lo, hi = floor.to(tl.int64), key_top.to(tl.int64)
        while lo < hi:
            mid = lo + (hi - lo) // 2
            _count, mass = _count_and_mass(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature,
                                           mid.to(tl.int32), floor, m_all, BLOCK)  # fmt: skip
            if mass < top_p * z_kept:
                hi = mid
            else:
                lo = mid + 1
        threshold = lo.to(tl.int32)
    return _race_from(
        logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, threshold, draw_seed, BLOCK
    )


@triton.jit
def _sorted_draw(key, value, index, r, p, n_exact, top_k, top_p, draw_seed):
    """With a top_k: the candidates in descending order (rank r, probability p under the exact denominator),
    the kept prefix and its draw. Returns (token, exact): not exact when the prefix may pass rank n_exact."""
    in_k = r < top_k
    p_k = tl.where(in_k, p, 0.0)
    above = (tl.cumsum(p_k, axis=0) - p_k) / tl.sum(p_k, axis=0)  # the top_k's mass strictly above each rank
    kept = in_k & ((above < top_p) | (r == 0))
    n_kept = tl.sum(kept.to(tl.int32), axis=0)
    # Ranks 0 .. n_exact are the vocabulary's own (rank n_exact is the first token with key T: some chunk's C-th
    # candidate is T, and a chunk holds its lowest-index ties first), so the kept prefix is exact when it stops
    # by rank n_exact: dropped there, or cut by a top_k of at most n_exact + 1.
    exact = (top_k <= n_exact + 1) & ((n_kept <= n_exact) | (n_kept == top_k))
    score = tl.where(kept, value + _gumbel(draw_seed, index), float("-inf"))
    best = tl.max(score, axis=0)
    return tl.min(tl.where(score == best, index, 0x7FFFFFFF), axis=0), exact


@triton.jit
def _sample_pick_kernel(
    logits_ptr,
    seen_ptr,
    params_ptr,
    seed_ptr,
    pos_ptr,
    cand_ptr,
    chunk_ml_ptr,
    race_val_ptr,
    race_idx_ptr,
    token_ptr,
    out_tokens_ptr,
    ring_ptr,
    info_ptr,
    vocab_limit,
    programs,
    PROGRAMS: tl.constexpr,
    C: tl.constexpr,
    ALL_CANDIDATES: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_DRAWS: tl.constexpr,
    RING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    temperature, top_k, top_p, penalty, inv_temperature = _params(params_ptr)
    pos = tl.load(pos_ptr)

    # The exact softmax denominator: sum_i s_i * exp(m_i - M) over the chunks.
    chunk = tl.arange(0, PROGRAMS)
    chunk_ok = chunk < programs
    ms = tl.load(chunk_ml_ptr + 2 * chunk, mask=chunk_ok, other=float("-inf"), cache_modifier=".cg")
    ss = tl.load(chunk_ml_ptr + 2 * chunk + 1, mask=chunk_ok, other=0.0, cache_modifier=".cg")
    m_all = tl.max(ms, axis=0)
    z_all = tl.sum(ss * tl.exp2((ms - m_all) * 1.4426950408889634), axis=0)

    # Every chunk's C largest (unsorted across chunks): [PROGRAMS * C].
    r = tl.arange(0, PROGRAMS * C)
    packed = tl.load(cand_ptr + r, mask=r < programs * C, other=-9223372036854775807, cache_modifier=".cg")
    # T: the largest of the chunks' C-th candidates. Every token with a key above T is a candidate (none, when
    # the chunks are C logits long or each holds fewer than C finite ones).
    last = tl.load(
        cand_ptr + chunk * C + C - 1, mask=chunk_ok, other=-9223372036854775807, cache_modifier=".cg"
    )
    t_key = tl.max((last >> 32).to(tl.int32), axis=0)
    if ALL_CANDIDATES | (t_key == _order_key(tl.full([], float("-inf"), tl.float32))):
        t_key = tl.full([], -2147483647 - 1, tl.int32)

    token = tl.zeros([], dtype=tl.int32)
    path = tl.zeros([], dtype=tl.int32)
    if temperature <= 0:  # greedy with a repetition penalty: the largest key, first index on ties
        token = 0x7FFFFFFF - (tl.max(packed, axis=0) & 0xFFFFFFFF).to(tl.int32)
        path = 3
    elif top_k == 0:
        # The chunks' draw over the whole vocabulary is a draw from p. With top_p < 1 it is kept when the mass
        # strictly above it is below top_p; otherwise it is drawn again (fresh noise) among the tokens above it,
        # which hold the whole nucleus: accepted draws are then distributed as p over the nucleus. Each draw
        # needs the candidates only while its key is at least T, else a pass over the vocabulary.
        vals = tl.load(race_val_ptr + chunk, mask=chunk_ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(race_idx_ptr + chunk, mask=chunk_ok, other=0x7FFFFFFF, cache_modifier=".cg")
        best = tl.max(vals, axis=0)
        token = tl.min(tl.where(vals == best, idxs, 0x7FFFFFFF), axis=0)
        path = 1
        if top_p < 1.0:
            key = (packed >> 32).to(tl.int32)
            value = _key_value(key)
            index = 0x7FFFFFFF - (packed & 0xFFFFFFFF).to(tl.int32)
            p = tl.exp2((value - m_all) * 1.4426950408889634) / z_all
            draw = tl.zeros([], dtype=tl.int32)
            done = tl.zeros([], dtype=tl.int1)
            while (done == 0) & (draw < MAX_DRAWS):
                l_token = _scaled_logits(logits_ptr, seen_ptr, token, vocab_limit, penalty, inv_temperature)
                key_token = _order_key(l_token)
                if key_token >= t_key:
                    above = tl.sum(tl.where(key > key_token, p, 0.0), axis=0)
                else:
                    _count, mass = _count_and_mass(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature,
                                                   key_token, key_token, m_all, BLOCK)  # fmt: skip
                    above = mass / z_all
                    path = 2
                done = above < top_p
                if done == 0:
                    draw += 1
                    draw_seed = _draw_seed(seed_ptr, pos, draw)
                    if key_token >= t_key:
                        score = tl.where(key > key_token, value + _gumbel(draw_seed, index), float("-inf"))
                        best = tl.max(score, axis=0)
                        token = tl.min(tl.where(score == best, index, 0x7FFFFFFF), axis=0)
                    else:
                        token = _race_from(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature,
                                           key_token + 1, draw_seed, BLOCK)  # fmt: skip
                        path = 2
            path = tl.where(path == 1, 0, path)
            tl.store(info_ptr + 5, tl.load(info_ptr + 5) + draw)
    else:
        # A top_k: the candidates sorted, exact when the kept prefix ends inside their exact prefix.
        packed = tl.sort(packed, descending=True)
        key = (packed >> 32).to(tl.int32)
        value = _key_value(key)
        index = 0x7FFFFFFF - (packed & 0xFFFFFFFF).to(tl.int32)
        p = tl.exp2((value - m_all) * 1.4426950408889634) / z_all
        n_exact = tl.sum((key > t_key).to(tl.int32), axis=0)
        draw_seed = _draw_seed(seed_ptr, pos, 0)
        token, exact = _sorted_draw(key, value, index, r, p, n_exact, top_k, top_p, draw_seed)
        path = 4
        if not exact:
            token = _bisection_draw(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, top_k, top_p,
                                    m_all, z_all, tl.max(key, axis=0), draw_seed, BLOCK)  # fmt: skip
            path = 2

    tl.store(token_ptr, token.to(token_ptr.dtype.element_ty))
    tl.store(out_tokens_ptr + pos + 1, token.to(out_tokens_ptr.dtype.element_ty))
    tl.store(seen_ptr + token, tl.full([], 1, seen_ptr.dtype.element_ty))
    if RING > 0:  # straight into the host's pinned ring, as the greedy head does
        tl.store(ring_ptr + (pos + 1) % RING, token.to(ring_ptr.dtype.element_ty))
    tl.store(pos_ptr, pos + 1)
    tl.store(info_ptr + path, tl.load(info_ptr + path) + 1)


def _pick_chunk(vocab: int, candidates: int) -> int:
    """Logits a scan program takes: at most 128 programs (the pick sorts programs * candidates keys)."""
    chunk = 1024
    while triton.cdiv(vocab, chunk) > 128:
        chunk *= 2
    return max(chunk, candidates)


class SampleScratch:
    """Per-chunk partials of the scan, and the per-path step counts (info, SAMPLE_PATHS)."""

    def __init__(self, vocab_size: int, device: torch.device, chunk: int | None = None, candidates: int = 16):
        if candidates < 1 or candidates & (candidates - 1):
            raise ValueError(f"candidates: expected a power of two, got {candidates}")
        chunk = chunk or _pick_chunk(vocab_size, candidates)
        if chunk < candidates or chunk & (chunk - 1):
            raise ValueError(f"chunk: expected a power of two >= candidates ({candidates}), got {chunk}")
        self.chunk, self.candidates = chunk, candidates
        self.programs = triton.cdiv(vocab_size, chunk)
        self.cand = torch.empty(self.programs * candidates, dtype=torch.int64, device=device)
        self.chunk_ml = torch.empty(2 * self.programs, dtype=torch.float32, device=device)
        self.race_val = torch.empty(self.programs, dtype=torch.float32, device=device)
        self.race_idx = torch.empty(self.programs, dtype=torch.int32, device=device)
        self.info = torch.zeros(len(SAMPLE_INFO), dtype=torch.int32, device=device)

    def path_counts(self) -> dict[str, int]:
        """Steps by path (SAMPLE_PATHS) and redraws, since the scratch was made."""
        return dict(zip(SAMPLE_INFO, self.info.tolist(), strict=True))


def sample_token(
    logits: torch.Tensor,
    seen: torch.Tensor,
    params: torch.Tensor,
    seed: torch.Tensor,
    scratch: SampleScratch,
    *,
    token: torch.Tensor,
    pos: torch.Tensor,
    out_tokens: torch.Tensor,
    vocab_limit: int | None = None,
    host_ring: torch.Tensor | None = None,
    use_pdl: bool = False,
) -> torch.Tensor:
    """token[0] = a draw from logits [V] fp32 under params [4] fp32 (temperature, top_k, top_p,
    repetition_penalty; temperature 0 is greedy), seen [V] bool marking the tokens the penalty applies to and
    seed [1] int64; then out_tokens[pos + 1] = token, seen[token] = True, pos += 1 and, with host_ring (pinned
    int tensor [R]), host_ring[(pos + 1) % R] = token. Tokens at or past vocab_limit are never drawn."""
    vocab = logits.numel()
    if logits.shape != (vocab,) or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits: expected a contiguous fp32 [V], got {logits.dtype} {tuple(logits.shape)}")
    if seen.shape != (vocab,) or seen.dtype != torch.bool:
        raise ValueError(f"seen: expected a bool [{vocab}], got {seen.dtype} {tuple(seen.shape)}")
    if params.shape != (4,) or params.dtype != torch.float32:
        raise ValueError(f"params: expected fp32 [4], got {params.dtype} {tuple(params.shape)}")
    if seed.shape != (1,) or seed.dtype != torch.int64:
        raise ValueError(f"seed: expected int64 [1], got {seed.dtype} {tuple(seed.shape)}")
    for name, t in (("token", token), ("pos", pos), ("out_tokens", out_tokens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an int32/int64 tensor, got {t.dtype}")
    if scratch.programs * scratch.chunk < vocab:
        raise ValueError(f"scratch: allocated for a vocabulary under {vocab}")
    vocab_limit = min(vocab_limit or vocab, vocab)
    partials = (scratch.cand, scratch.chunk_ml, scratch.race_val, scratch.race_idx)
    common = (logits, seen, params, seed, pos, *partials)
    _sample_scan_kernel[(scratch.programs,)](
        *common, vocab_limit, CHUNK=scratch.chunk, C=scratch.candidates, USE_PDL=use_pdl,
        num_warps=4, **pdl_kwargs(use_pdl),
    )  # fmt: skip
    _sample_pick_kernel[(1,)](
        *common, token, out_tokens, host_ring if host_ring is not None else token, scratch.info, vocab_limit,
        scratch.programs, PROGRAMS=triton.next_power_of_2(scratch.programs), C=scratch.candidates,
        ALL_CANDIDATES=scratch.chunk == scratch.candidates, MAX_DRAWS=MAX_DRAWS, BLOCK=256 if interpreted() else 2048, RING=host_ring.numel() if host_ring is not None else 0,
        USE_PDL=use_pdl, num_warps=8, **pdl_kwargs(use_pdl),
    )  # fmt: skip
    return token


@triton.jit
def _gumbel_kernel(seed_ptr, pos_ptr, out_ptr, n, draw, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    step = tl.program_id(1)
    draw_seed = _draw_seed(seed_ptr, tl.load(pos_ptr) + step, draw)
    tl.store(out_ptr + step * n + offs, _gumbel(draw_seed, offs), mask=offs < n)


def gumbel_noise(
    seed: torch.Tensor, pos: torch.Tensor, n: int, steps: int = 1, draw: int = 0
) -> torch.Tensor:
    """The noise sample_token adds to tokens [0, n) in draw `draw` at positions pos[0] .. pos[0] + steps - 1
    with seed[0]: [steps, n] fp32 (for checks)."""
    out = torch.empty(steps, n, dtype=torch.float32, device=seed.device)
    _gumbel_kernel[(triton.cdiv(n, 1024), steps)](seed, pos, out, n, draw, BLOCK=1024)
    return out
