"""The sampled step's token from the head's logits in two launches: repetition penalty, temperature, top-k,
top-p and the draw, then the step's bookkeeping, all on the device.

    l_v = logits[v] (-inf at v >= vocab_limit), penalised where seen[v] (l > 0: l / r, else l * r), / temperature
    kept = the top_k largest l (all when top_k = 0), then the smallest prefix of them, in descending order,
           whose probability (renormalised over the top_k) reaches top_p; the largest is always kept
    token = argmax_{v kept} l_v + Gumbel_v   (a draw from softmax(l) restricted to `kept`)
    temperature 0 (greedy with a repetition penalty): token = argmax l_v, first index on ties

The Gumbel noise of token v at position p is a function of (seed, p, v) (Philox): the same in both launches, so
a draw over any subset of the vocabulary agrees with one over the whole of it, and a seed repeats its tokens.

Launch 1, `_sample_scan_kernel` (P programs, each a chunk of CHUNK logits): the chunk's maximum and softmax sum,
its C largest logits as keys that sort like (value, -index), and its best l + Gumbel. Launch 2,
`_sample_pick_kernel` (one program): the exact softmax denominator from the P partial sums, the P * C candidates
sorted, then:
- top_p = 1 and top_k = 0: the best of the P chunk draws (the whole vocabulary raced, nothing to sort);
- otherwise, when the kept prefix ends inside the candidates' exact prefix (every token above T, the largest of
  the chunks' C-th candidates, is a candidate; so the prefix up to T is the vocabulary's own sorted order): the
  race over the kept candidates. This is the common case: a code model's nucleus is a few tokens;
- otherwise (a nucleus wider than the candidates' exact prefix) the thresholds are found exactly by bisection on
  the keys over the whole vocabulary in this program (up to ~66 passes over the logits: slow, but exact). Ties at
  a threshold are then all kept (as transformers' top-k does), where the sorted path keeps the lower indices.

`info` counts the steps taken by each path (SAMPLE_PATHS), for tests and the benchmark.

Bytes: the logits (4 V) and the seen flags (V) once in launch 1, P * C candidates in launch 2.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs

SAMPLE_PATHS = ("candidates", "whole vocabulary", "bisection", "greedy")
_LOG2E = 1.4426950408889634
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

    if (temperature > 0) & (top_p >= 1.0) & (top_k == 0):  # nothing is cut: this chunk's draw
        step_seed = tl.randint(tl.load(seed_ptr), tl.load(pos_ptr))
        score = lg + _gumbel(step_seed, offs)
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
def _bisection_draw(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, top_k, top_p, m_all, z_all,
                    key_top, step_seed, BLOCK: tl.constexpr):  # fmt: skip
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
    best = tl.full([], float("-inf"), tl.float32)
    token = tl.zeros([], dtype=tl.int32)
    start = 0
    while start < vocab_limit:
        offs = start + tl.arange(0, BLOCK)
        lg = _scaled_logits(logits_ptr, seen_ptr, offs, vocab_limit, penalty, inv_temperature)
        kept = (_order_key(lg) >= threshold) & (offs < vocab_limit)
        score = tl.where(kept, lg + _gumbel(step_seed, offs), float("-inf"))
        block_best = tl.max(score, axis=0)
        block_at = tl.min(tl.where(score == block_best, offs, 0x7FFFFFFF), axis=0)
        take = block_best > best
        best, token = tl.where(take, block_best, best), tl.where(take, block_at, token)
        start += BLOCK
    return token


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
    RING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    temperature, top_k, top_p, penalty, inv_temperature = _params(params_ptr)
    pos = tl.load(pos_ptr)
    step_seed = tl.randint(tl.load(seed_ptr), pos)

    # The exact softmax denominator: sum_i s_i * exp(m_i - M) over the chunks.
    chunk = tl.arange(0, PROGRAMS)
    chunk_ok = chunk < programs
    ms = tl.load(chunk_ml_ptr + 2 * chunk, mask=chunk_ok, other=float("-inf"), cache_modifier=".cg")
    ss = tl.load(chunk_ml_ptr + 2 * chunk + 1, mask=chunk_ok, other=0.0, cache_modifier=".cg")
    m_all = tl.max(ms, axis=0)
    z_all = tl.sum(ss * tl.exp2((ms - m_all) * 1.4426950408889634), axis=0)

    # Every chunk's C largest, sorted: [PROGRAMS * C], rank r.
    r = tl.arange(0, PROGRAMS * C)
    packed = tl.load(cand_ptr + r, mask=r < programs * C, other=-9223372036854775807, cache_modifier=".cg")
    packed = tl.sort(packed, descending=True)
    key = (packed >> 32).to(tl.int32)
    value = _key_value(key)
    index = 0x7FFFFFFF - (packed & 0xFFFFFFFF).to(tl.int32)

    token = tl.zeros([], dtype=tl.int32)
    path = tl.zeros([], dtype=tl.int32)
    if temperature <= 0:  # greedy with a repetition penalty: the first of the sorted order
        token = tl.max(tl.where(r == 0, index, -1), axis=0)
        path = 3
    elif (top_p >= 1.0) & (top_k == 0):  # the whole vocabulary raced by the chunks
        vals = tl.load(race_val_ptr + chunk, mask=chunk_ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(race_idx_ptr + chunk, mask=chunk_ok, other=0x7FFFFFFF, cache_modifier=".cg")
        best = tl.max(vals, axis=0)
        token = tl.min(tl.where(vals == best, idxs, 0x7FFFFFFF), axis=0)
        path = 1
    else:
        # T: the largest of the chunks' C-th candidates; every token with a key above T is a candidate.
        last = tl.load(cand_ptr + chunk * C + C - 1, mask=chunk_ok, other=-9223372036854775807,
                       cache_modifier=".cg")  # fmt: skip
        t_key = tl.max((last >> 32).to(tl.int32), axis=0)
        n_exact = tl.sum((key > t_key).to(tl.int32), axis=0)
        p = tl.exp2((value - m_all) * 1.4426950408889634) / z_all
        in_k = (top_k == 0) | (r < top_k)
        p_k = tl.where(in_k, p, 0.0)
        z_k = tl.where(top_k > 0, tl.sum(p_k, axis=0), 1.0)
        above = (tl.cumsum(p_k, axis=0) - p_k) / z_k  # the kept top_k's mass strictly above each rank
        kept = in_k & ((above < top_p) | (r == 0))
        n_kept = tl.sum(kept.to(tl.int32), axis=0)
        # (chunks of C logits, or every chunk holding fewer than C finite ones)
        minus_inf_key = _order_key(tl.full([], float("-inf"), tl.float32))
        every_token_a_candidate = ALL_CANDIDATES | (t_key == minus_inf_key)
        # Ranks 0 .. n_exact are the vocabulary's own (rank n_exact is the first token with key T: some chunk's
        # C-th candidate is T, and a chunk holds its lowest-index ties first), so the kept prefix is exact when
        # it stops by rank n_exact: dropped there, or cut by a top_k of at most n_exact + 1.
        k_inside = (top_k == 0) | (top_k <= n_exact + 1)
        exact = every_token_a_candidate | (k_inside & ((n_kept <= n_exact) | (n_kept == top_k)))
        if exact:
            score = tl.where(kept, value + _gumbel(step_seed, index), float("-inf"))
            best = tl.max(score, axis=0)
            token = tl.min(tl.where(score == best, index, 0x7FFFFFFF), axis=0)
            path = 0
        else:
            key_top = tl.max(key, axis=0)
            token = _bisection_draw(logits_ptr, seen_ptr, vocab_limit, penalty, inv_temperature, top_k, top_p,
                                    m_all, z_all, key_top, step_seed, BLOCK)  # fmt: skip
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
        self.info = torch.zeros(len(SAMPLE_PATHS), dtype=torch.int32, device=device)

    def path_counts(self) -> dict[str, int]:
        return dict(zip(SAMPLE_PATHS, self.info.tolist(), strict=True))


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
        ALL_CANDIDATES=scratch.chunk == scratch.candidates, BLOCK=256 if interpreted() else 2048, RING=host_ring.numel() if host_ring is not None else 0,
        USE_PDL=use_pdl, num_warps=8, **pdl_kwargs(use_pdl),
    )  # fmt: skip
    return token


@triton.jit
def _gumbel_kernel(seed_ptr, pos_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    step = tl.program_id(1)
    step_seed = tl.randint(tl.load(seed_ptr), tl.load(pos_ptr) + step)
    tl.store(out_ptr + step * n + offs, _gumbel(step_seed, offs), mask=offs < n)


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, n: int, steps: int = 1) -> torch.Tensor:
    """The noise sample_token adds to tokens [0, n) at positions pos[0] .. pos[0] + steps - 1 with seed[0]:
    [steps, n] fp32 (for checks)."""
    out = torch.empty(steps, n, dtype=torch.float32, device=seed.device)
    _gumbel_kernel[(triton.cdiv(n, 1024), steps)](seed, pos, out, n, BLOCK=1024)
    return out
