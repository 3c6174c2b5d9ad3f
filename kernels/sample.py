"""The sampled step's token from the head's logits in two launches: repetition penalty, temperature, top-k,
top-p and the draw, then the step's bookkeeping, all on the device.

    l_v = logits[v] (-inf at v >= vocab_limit), penalised where seen[v] (l > 0: l / r, else l * r), / temperature
    F = the top_k largest l (with their ties; the whole vocabulary when top_k = 0)
    kept = the smallest prefix of F, in descending order, whose probability (renormalised over F) reaches
           top_p; the largest is always kept
    token ~ softmax(l) over `kept`; temperature 0 (greedy with a repetition penalty): argmax l, first on ties

How: a draw from softmax(l) over F is argmax_v l_v + Gumbel_v (the Gumbel-max trick); the Gumbel noise of token
v in draw d at position p is a function of (seed, p, d, v) (Philox), so launches agree on it without sharing
it and a seed repeats its tokens. The draw is kept when F's mass strictly above it is below top_p of F's;
otherwise it is drawn again, with fresh noise, among F's tokens above it, which hold the whole nucleus. That is
rejection sampling: the accepted draw is distributed as softmax(l) over the nucleus, a redraw happens with
probability at most 1 - top_p, and each one shrinks the field. Nothing is sorted.

Launch 1, `_sample_scan_kernel` (P programs, each a chunk of CHUNK logits): the chunk's maximum and softmax sum,
its C largest logits as int64 keys that order like (value, -index), and, without a top_k, its best l + Gumbel
(the first draw, over the whole vocabulary). Launch 2, `_sample_pick_kernel` (one program): the exact softmax
denominator from the P partial sums and T, the largest of the chunks' C-th candidates: every token with a key
above T is a candidate. So F's k-th largest key (a radix select over the candidates' keys), F's mass, the
first draw over F, and the mass above any draw with key >= T are all masked sums over the candidates. A top_k
larger than the candidates above T costs one pass over the vocabulary, in this one program: it writes the band,
the tokens with a key between the candidates' k-th key (they are part of the vocabulary, so F's lowest key is
at least theirs) and T, and the rest of the step works on the candidates above T and the band (usually a few
hundred tokens). Without a top_k, a draw below T (a nucleus wider than the candidates' exact prefix, at a high
temperature) costs passes over the vocabulary (the mass above it; a redraw).

`info` counts the steps by path (SAMPLE_PATHS) and the redraws, for tests and the benchmark.

Bytes: the logits (4 V) and the seen flags (V) once in launch 1, P * C candidates in launch 2 (and, for the
band, the logits and flags once more and the band twice per radix digit).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs

# What info counts: steps by path (a top_p settled from the candidates; nothing cut; the band's pass over the
# vocabulary needed; greedy with a repetition penalty; a top_k settled from the candidates), then redraws.
SAMPLE_PATHS = ("nucleus", "whole vocabulary", "vocabulary pass", "greedy", "top-k")
SAMPLE_INFO = (*SAMPLE_PATHS, "redraws")
_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))
# Bits of a radix-select digit: 4-bit digits selected a top_k from the candidates sooner than 8-bit ones. A radix
# pass over the whole vocabulary is slow (tl.histogram updates element by element; [block, 16] compares were
# worse), which is why a wide top_k selects from the band instead (docs/fast-path.md).
RADIX_BITS = tl.constexpr(4)
RADIX_BINS = tl.constexpr(16)  # 2 ** RADIX_BITS
# Band entries a loop step reads (the band is usually a few hundred tokens; a pass over the vocabulary reads
# 2,048 logits a step).
BAND_BLOCK = 512
# Logits a loop step of the band's pass reads: fewer leave the pass slower, 4,096 gains little for many more
# registers, and 8,192 spills.
FILL_BLOCK = 2048
MAX_DRAWS = 64  # redraws of a step, at most (each draw shrinks the field strictly; the expected count is < 1)
# A packed key's low half holds _INDEX_MAX - index: lower indices sort higher. (Kernels write it
# -index + _INDEX_MAX: a tensor on the left, which the interpreter needs.)
_INDEX_MAX = tl.constexpr(0x7FFFFFFF)
# The lowest order key (below every float's, -inf included): "no bound" for a floor, and the key of padding.
_KEY_MIN = tl.constexpr(-(2**31))
# What a padding slot of the packed candidates or band loads as: below every real entry.
_PACKED_PAD = tl.constexpr(-(2**63) + 1)


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
def penalised(lg, seen, penalty):
    """The repetition penalty on the logits of seen tokens (l > 0: l / r, else l * r): increasing in l for any
    r > 0, so it maps bounds on a logit to bounds on its penalised value (kernels/lm_head_screen.py)."""
    return tl.where(seen, tl.where(lg > 0, lg / penalty, lg * penalty), lg)


@triton.jit
def _scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature):
    """l for the tokens at offs: -inf outside the vocabulary, the repetition penalty on seen tokens, then the
    temperature."""
    ok = offs < vocab_limit
    lg = tl.load(logits_ptr + offs, mask=ok, other=float("-inf"))
    seen = tl.load(seen_ptr + offs, mask=ok, other=0).to(tl.int1)
    return penalised(lg, seen, penalty) * inv_temperature


@triton.jit
def _gumbel(step_seed, offs):
    """Gumbel(0, 1) noise of tokens offs at this step: -log(-log(u)), u uniform in [0, 1); u = 0 gives -inf
    (never drawn)."""
    u = tl.rand(step_seed, offs)
    return -tl.log(-tl.log(u))


@triton.jit
def _unpack(packed):
    """An int64 candidate key -> (order key, token)."""
    return (packed >> 32).to(tl.int32), -(packed & 0xFFFFFFFF).to(tl.int32) + _INDEX_MAX


@triton.jit
def _first_argmax(score, index):
    """(max of score, the lowest index holding it): a draw's winner, ties to the first token."""
    best = tl.max(score, axis=0)
    return best, tl.min(tl.where(score == best, index, _INDEX_MAX), axis=0)


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
def _sample_scan_kernel(logits_ptr, seen_ptr, params_ptr, seed_ptr, pos_ptr,  # the step's inputs
                        cand_ptr, chunk_ml_ptr, race_val_ptr, race_idx_ptr,  # this launch's outputs
                        vocab_limit, CHUNK: tl.constexpr, C: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
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
    tl.store(chunk_ml_ptr + 2 * pid + 1, tl.sum(tl.exp2((lg - m_safe) * _LOG2E), axis=0))

    # The C largest, as int64 keys (order key of l << 32 | INDEX_MAX - v): sorted, ties go to the lower index.
    packed = (_order_key(lg).to(tl.int64) << 32) | (-offs + _INDEX_MAX).to(tl.int64)
    tl.store(cand_ptr + pid * C + tl.arange(0, C), tl.topk(packed, C))

    if (temperature > 0) & ((top_k == 0) | (top_k >= vocab_limit)):  # its part of a draw over the vocabulary
        best, at = _first_argmax(lg + _gumbel(_draw_seed(seed_ptr, tl.load(pos_ptr), 0), offs), offs)
        tl.store(race_val_ptr + pid, best)
        tl.store(race_idx_ptr + pid, at)


@triton.jit
def _mass_above(
    logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, above, m_all, BLOCK: tl.constexpr
):
    """One pass over the vocabulary: the softmax mass (unnormalised, relative to m_all) of the keys > above."""
    mass = tl.zeros([], dtype=tl.float32)
    start = 0
    while start < vocab_limit:  # a while loop: the interpreter takes no tensor bound in range()
        offs = start + tl.arange(0, BLOCK)
        lg = _scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature)
        mass += tl.sum(tl.where(_order_key(lg) > above, tl.exp2((lg - m_all) * _LOG2E), 0.0), axis=0)
        start += BLOCK
    return mass


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
        block_best, block_at = _first_argmax(
            tl.where(inside, lg + _gumbel(draw_seed, offs), float("-inf")), offs
        )
        take = block_best > best
        best, token = tl.where(take, block_best, best), tl.where(take, block_at, token)
        start += BLOCK
    return token


@triton.jit
def _radix_step(hist, remaining, prefix, SHIFT: tl.constexpr):
    """One digit of a radix select, from a count histogram of the RADIX_BITS digit at SHIFT: the digit is the
    highest bin whose count from the top (itself included) reaches `remaining`. Returns (remaining less the
    count strictly above that bin, prefix with the digit)."""
    bins = tl.arange(0, RADIX_BINS)
    from_top = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    digit = tl.max(tl.where(from_top >= remaining, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > digit, hist, 0), axis=0)
    return remaining - above, prefix + (digit.to(tl.int64) << SHIFT)


@triton.jit
def _digit_histogram(key, ok, prefix, SHIFT: tl.constexpr):
    """Counts of the RADIX_BITS digit at SHIFT of the keys (as unsigned: key + 2^31) whose higher digits are
    prefix's."""
    u = key.to(tl.int64) - _KEY_MIN
    match = ok & ((u >> (SHIFT + RADIX_BITS)) == (prefix >> (SHIFT + RADIX_BITS)))
    return tl.histogram(((u >> SHIFT) & (RADIX_BINS - 1)).to(tl.int32), RADIX_BINS, mask=match)


@triton.jit
def _kth_key_of_candidates(key, ok, k):
    """The k-th largest of the keys (radix select, most significant digit first; ties counted), k <= how many
    are ok."""
    prefix = tl.zeros([], dtype=tl.int64)
    remaining = k
    for d in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (d + 1)
        remaining, prefix = _radix_step(_digit_histogram(key, ok, prefix, shift), remaining, prefix, shift)
    return (prefix + _KEY_MIN).to(tl.int32)


@triton.jit
def _fill_band(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, low, high, band_ptr,
               BLOCK: tl.constexpr):  # fmt: skip
    """The step's one pass over the vocabulary: the tokens with low <= key <= high, packed like the candidates,
    written to band_ptr[0, n); returns n. (The tokens above high, T, are all candidates already.)"""
    n = tl.zeros([], dtype=tl.int32)
    start = 0
    while start < vocab_limit:  # a while loop: the interpreter takes no tensor bound in range()
        offs = start + tl.arange(0, BLOCK)
        key = _order_key(_scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature))
        inside = (key >= low) & (key <= high) & (offs < vocab_limit)
        slot = n + tl.cumsum(inside.to(tl.int32), axis=0) - 1
        packed = (key.to(tl.int64) << 32) | (-offs + _INDEX_MAX).to(tl.int64)
        tl.store(band_ptr + slot, packed, mask=inside)
        n += tl.sum(inside.to(tl.int32), axis=0)
        start += BLOCK
    tl.debug_barrier()  # every thread's band entries are written before any thread reads them
    return n


@triton.jit
def _load_band(band_ptr, n_band, start, BLOCK: tl.constexpr):
    """Band entries [start, start + BLOCK) as (ok, key, value, index); L1 is bypassed: this program wrote them."""
    r = start + tl.arange(0, BLOCK)
    ok = r < n_band
    key, index = _unpack(tl.load(band_ptr + r, mask=ok, other=_PACKED_PAD, cache_modifier=".cg"))
    return ok, key, tl.where(ok, _key_value(key), float("-inf")), index


@triton.jit
def _kth_key_of_band(band_ptr, n_band, k, BLOCK: tl.constexpr):
    """The k-th largest key of the band, k <= n_band: radix select, a pass over the band per digit."""
    prefix = tl.zeros([], dtype=tl.int64)
    remaining = k
    for d in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (d + 1)
        hist = tl.zeros([RADIX_BINS], dtype=tl.int32)
        start = 0
        while start < n_band:
            ok, key, _, _ = _load_band(band_ptr, n_band, start, BLOCK)
            hist += _digit_histogram(key, ok, prefix, shift)
            start += BLOCK
        remaining, prefix = _radix_step(hist, remaining, prefix, shift)
    return (prefix + _KEY_MIN).to(tl.int32)


@triton.jit
def _band_mass(band_ptr, n_band, floor, m_all, BLOCK: tl.constexpr):
    """The softmax mass (unnormalised, relative to m_all) of the band's keys >= floor."""
    mass = tl.zeros([], dtype=tl.float32)
    start = 0
    while start < n_band:
        ok, key, value, _ = _load_band(band_ptr, n_band, start, BLOCK)
        mass += tl.sum(tl.where(ok & (key >= floor), tl.exp2((value - m_all) * _LOG2E), 0.0), axis=0)
        start += BLOCK
    return mass


@triton.jit
def _candidates_race(key, value, index, floor, draw_seed):
    """The draw among the candidates with a key >= floor: (l + Gumbel of the winner, its token; first index on
    ties)."""
    return _first_argmax(tl.where(key >= floor, value + _gumbel(draw_seed, index), float("-inf")), index)


@triton.jit
def _race_with_band(key, value, index, band_ptr, n_band, floor, draw_seed, BLOCK: tl.constexpr):
    """The draw among the tokens with a key >= floor, for floor <= T: the candidates and the band's (a token in
    both races twice with the same noise, which changes no winner)."""
    best, token = _candidates_race(key, value, index, floor, draw_seed)
    start = 0
    while start < n_band:
        ok, b_key, b_value, b_index = _load_band(band_ptr, n_band, start, BLOCK)
        score = tl.where(ok & (b_key >= floor), b_value + _gumbel(draw_seed, b_index), float("-inf"))
        block_best, block_at = _first_argmax(score, tl.where(ok, b_index, _INDEX_MAX))
        take = (block_best > best) | ((block_best == best) & (block_at < token))
        best, token = tl.where(take, block_best, best), tl.where(take, block_at, token)
        start += BLOCK
    return token


@triton.jit
def _sample_pick_kernel(logits_ptr, seen_ptr, params_ptr, seed_ptr, pos_ptr,  # as the scan's
                        cand_ptr, chunk_ml_ptr, race_val_ptr, race_idx_ptr,  # the scan's outputs
                        token_ptr, out_tokens_ptr, ring_ptr, info_ptr, band_ptr,  # bookkeeping, path counts, band
                        vocab_limit, programs, PROGRAMS: tl.constexpr, C: tl.constexpr, ALL_CANDIDATES: tl.constexpr,
                        BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr, BAND_BLOCK: tl.constexpr,
                        MAX_DRAWS: tl.constexpr, RING: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
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
    z_all = tl.sum(ss * tl.exp2((ms - m_all) * _LOG2E), axis=0)

    # Every chunk's C largest (unsorted across chunks): [PROGRAMS * C].
    r = tl.arange(0, PROGRAMS * C)
    r_ok = r < programs * C
    packed = tl.load(cand_ptr + r, mask=r_ok, other=_PACKED_PAD, cache_modifier=".cg")
    # T: the largest of the chunks' C-th candidates. Every token with a key above T is a candidate (none, when
    # the chunks are C logits long or each holds fewer than C finite ones).
    last = tl.load(cand_ptr + chunk * C + C - 1, mask=chunk_ok, other=_PACKED_PAD, cache_modifier=".cg")
    t_key = tl.max((last >> 32).to(tl.int32), axis=0)
    no_t = ALL_CANDIDATES | (t_key == _order_key(tl.full([], float("-inf"), tl.float32)))
    if no_t:
        t_key = tl.full([], _KEY_MIN, tl.int32)

    token = tl.zeros([], dtype=tl.int32)
    path = tl.zeros([], dtype=tl.int32)
    if temperature <= 0:  # greedy with a repetition penalty: the largest key, first index on ties
        token = _unpack(tl.max(packed, axis=0))[1]
        path = 3
    else:
        key, index = _unpack(packed)
        value = tl.where(key == _KEY_MIN, float("-inf"), _key_value(key))  # (padding: -inf)
        p = tl.exp2((value - m_all) * _LOG2E) / z_all  # [PROGRAMS * C], exact probabilities
        # The band: the tokens with a key in [low, T], written by the step's one pass over the vocabulary when a
        # top_k reaches below T. With the candidates above T it holds all of F.
        n_band = tl.full([], -1, tl.int32)  # its size; -1: no band this step
        mass_above_t = tl.zeros([], dtype=tl.float32)  # the candidates' above T (set with the band)
        # The field F: the tokens with key >= floor (the top_k's, ties included; everything without a top_k),
        # its mass z_f (of z_all), and a first draw from softmax(l) over it, with draw 0's noise.
        floor = tl.full([], _KEY_MIN, tl.int32)
        z_f = 1.0
        path = tl.where(top_p < 1.0, 0, 1)
        if (top_k == 0) | (top_k >= vocab_limit):  # the chunks raced the whole vocabulary
            vals = tl.load(race_val_ptr + chunk, mask=chunk_ok, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(race_idx_ptr + chunk, mask=chunk_ok, other=_INDEX_MAX, cache_modifier=".cg")
            token = _first_argmax(vals, idxs)[1]
        else:
            n_exact = tl.sum((key > t_key).to(tl.int32), axis=0)
            # The top_k all candidates (and so are all their ties: floor > T), or F reaches below T: the band.
            if (top_k <= n_exact) | no_t:
                floor = _kth_key_of_candidates(key, r_ok, tl.minimum(top_k, n_exact))
                z_f = tl.sum(tl.where(key >= floor, p, 0.0), axis=0)
                token = _candidates_race(key, value, index, floor, _draw_seed(seed_ptr, pos, 0))[1]
                path = 4
            else:
                # F's lowest key is at most T, and at least the candidates' k-th (they are part of the vocabulary).
                low = tl.full([], _KEY_MIN, tl.int32)
                if top_k <= programs * C:
                    low = _kth_key_of_candidates(key, r_ok, top_k)
                n_band = _fill_band(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, low, t_key,
                                    band_ptr, FILL_BLOCK)  # fmt: skip
                mass_above_t = tl.sum(tl.where(key > t_key, p, 0.0), axis=0)
                floor = _kth_key_of_band(band_ptr, n_band, top_k - n_exact, BAND_BLOCK)
                z_f = mass_above_t + _band_mass(band_ptr, n_band, floor, m_all, BAND_BLOCK) / z_all
                token = _race_with_band(key, value, index, band_ptr, n_band, floor, _draw_seed(seed_ptr, pos, 0),
                                        BAND_BLOCK)  # fmt: skip
                path = 2
        if top_p < 1.0:
            # Rejection: the draw is kept when F's mass strictly above it is below top_p of F's; otherwise it is
            # drawn again (fresh noise) among the tokens of F above it, which hold the whole nucleus. Above T that
            # is the candidates'; below, the band's too when a wide top_k made one, else a pass over the
            # vocabulary (a flat nucleus: its band would hold most of the vocabulary).
            draw = tl.zeros([], dtype=tl.int32)
            done = tl.zeros([], dtype=tl.int1)
            while (done == 0) & (draw < MAX_DRAWS):
                key_token = _order_key(
                    _scaled_logits(logits_ptr, seen_ptr, token, vocab_limit, penalty, inv_temperature)
                )
                if key_token >= t_key:
                    above = tl.sum(tl.where(key > key_token, p, 0.0), axis=0)
                elif n_band >= 0:
                    above = (
                        mass_above_t + _band_mass(band_ptr, n_band, key_token + 1, m_all, BAND_BLOCK) / z_all
                    )
                else:
                    above = _mass_above(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, key_token,
                                        m_all, BLOCK) / z_all  # fmt: skip
                    path = 2
                done = above < top_p * z_f
                if done == 0:
                    draw += 1
                    draw_seed = _draw_seed(seed_ptr, pos, draw)
                    if key_token >= t_key:
                        token = _candidates_race(key, value, index, key_token + 1, draw_seed)[1]
                    elif n_band >= 0:
                        token = _race_with_band(key, value, index, band_ptr, n_band, key_token + 1, draw_seed,
                                                BAND_BLOCK)  # fmt: skip
                    else:
                        token = _race_from(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature,
                                           key_token + 1, draw_seed, BLOCK)  # fmt: skip
            tl.store(info_ptr + 5, tl.load(info_ptr + 5) + draw)

    tl.store(token_ptr, token.to(token_ptr.dtype.element_ty))
    tl.store(out_tokens_ptr + pos + 1, token.to(out_tokens_ptr.dtype.element_ty))
    tl.store(seen_ptr + token, tl.full([], 1, seen_ptr.dtype.element_ty))
    if RING > 0:  # straight into the host's pinned ring, as the greedy head does
        tl.store(ring_ptr + (pos + 1) % RING, token.to(ring_ptr.dtype.element_ty))
    tl.store(pos_ptr, pos + 1)
    tl.store(info_ptr + path, tl.load(info_ptr + path) + 1)


def _pick_blocks(vocab: int) -> tuple[int, int]:
    """(chunk, candidates): chunks of 1,024 logits (more, smaller scan programs finish sooner), and at most
    2,048 candidates for the pick (its masked sums and radix select cost in proportion), 16 a chunk at most.
    Chunks of 2,048 made the page's sampled step slower (docs/fast-path.md)."""
    chunk = 1024
    while triton.cdiv(vocab, chunk) > 256:
        chunk *= 2
    return chunk, min(16, max(4, 2048 // triton.next_power_of_2(triton.cdiv(vocab, chunk))))


class SampleScratch:
    """Per-chunk partials of the scan, and the per-path step counts (info, SAMPLE_PATHS)."""

    def __init__(self, vocab_size: int, device: torch.device, chunk: int | None = None,
                 candidates: int | None = None):  # fmt: skip
        auto_chunk, auto_candidates = _pick_blocks(vocab_size)
        chunk, candidates = chunk or auto_chunk, candidates or auto_candidates
        if candidates < 1 or candidates & (candidates - 1):
            raise ValueError(f"candidates: expected a power of two, got {candidates}")
        if chunk < candidates or chunk & (chunk - 1):
            raise ValueError(f"chunk: expected a power of two >= candidates ({candidates}), got {chunk}")
        self.chunk, self.candidates = chunk, candidates
        self.programs = triton.cdiv(vocab_size, chunk)
        self.cand = torch.empty(self.programs * candidates, dtype=torch.int64, device=device)
        self.chunk_ml = torch.empty(2 * self.programs, dtype=torch.float32, device=device)
        self.race_val = torch.empty(self.programs, dtype=torch.float32, device=device)
        self.race_idx = torch.empty(self.programs, dtype=torch.int32, device=device)
        self.band = torch.empty(self.programs * chunk, dtype=torch.int64, device=device)
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
        *common, token, out_tokens, host_ring if host_ring is not None else token, scratch.info, scratch.band,
        vocab_limit,
        scratch.programs, PROGRAMS=triton.next_power_of_2(scratch.programs), C=scratch.candidates,
        ALL_CANDIDATES=scratch.chunk == scratch.candidates, MAX_DRAWS=MAX_DRAWS,
        BLOCK=256 if interpreted() else 2048, FILL_BLOCK=256 if interpreted() else FILL_BLOCK,
        BAND_BLOCK=128 if interpreted() else BAND_BLOCK,
        RING=host_ring.numel() if host_ring is not None else 0,
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
