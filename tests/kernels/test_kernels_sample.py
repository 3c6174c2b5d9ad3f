import math

import pytest
import torch

from kernels.sample import SAMPLE_PATHS, SampleScratch, gumbel_noise, sample_token
from tests.support.kernels import DEVICE


def reference_draw(logits, seen, params, vocab_limit, noise):
    """fp64 on the CPU, the sampler's rules written out with a full sort: (token, size of the kept set).
    noise(d): the Gumbel noise [V] of draw d. Draw 0 races F (the top_k, or everything); a draw outside the
    kept prefix is drawn again among F's tokens above it."""
    temperature, top_k, top_p, penalty = params.tolist()
    lg = logits.double().cpu().clone()
    lg[vocab_limit:] = float("-inf")
    seen = seen.cpu()
    lg = torch.where(seen, torch.where(lg > 0, lg / penalty, lg * penalty), lg)
    if temperature == 0:
        return int(lg.argmax()), 1
    lg = lg / temperature
    order = torch.sort(lg, descending=True, stable=True).indices
    in_f = torch.ones(len(order), dtype=torch.bool)
    if top_k > 0:
        in_f[int(top_k) :] = False
    probs = torch.where(in_f, lg[order], float("-inf")).softmax(0)
    above = probs.cumsum(0) - probs  # F's mass strictly above each rank
    kept = order[in_f & ((above < top_p) | (torch.arange(len(order)) == 0))].tolist()
    field = torch.zeros(len(lg), dtype=torch.bool)
    field[order[in_f]] = True
    p = torch.where(field, lg, float("-inf")).softmax(0)
    token = int(torch.where(field, lg + noise(0), float("-inf")).argmax())
    for draw in range(1, 65):
        if p[lg > lg[token]].sum() < top_p:
            break
        field &= lg > lg[token]
        token = int(torch.where(field, lg + noise(draw), float("-inf")).argmax())
    assert token in kept
    return token, len(kept)


def ints(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def run(logits, seen, params, scratch, seed=1234, pos=5, vocab_limit=None, ring=None):
    token, pos_t, out_tokens = ints(-1), ints(pos), ints(*([-1] * (pos + 3)))
    seed_t = ints(seed, dtype=torch.int64)
    params_t = torch.tensor(params, dtype=torch.float32, device=DEVICE)
    before = seen.clone()
    sample_token(logits, seen, params_t, seed_t, scratch, token=token, pos=pos_t, out_tokens=out_tokens,
                 vocab_limit=vocab_limit, host_ring=ring)  # fmt: skip

    def noise(draw):
        return gumbel_noise(seed_t, ints(pos), logits.numel(), draw=draw)[0].double().cpu()

    want, kept = reference_draw(logits, before, params_t, vocab_limit or logits.numel(), noise)
    got = token.item()
    assert pos_t.item() == pos + 1
    assert out_tokens[pos + 1].item() == got
    assert seen[got].item() and int(seen.sum()) == int(before.sum()) + (not before[got].item())
    return got, want, kept


# (temperature, top_k, top_p, repetition penalty): a nucleus, nothing cut, greedy with a penalty, top-k and
# top-p together, a wide nucleus, top-k alone, a top-k wider than the candidates, a top-k past the vocabulary
PARAMS = [(0.7, 0, 0.9, 1.0), (0.7, 0, 1.0, 1.0), (0.0, 0, 1.0, 1.3), (0.7, 50, 0.95, 1.2), (2.0, 0, 0.99, 1.0),
          (1.0, 5, 1.0, 1.0), (1.0, 300, 1.0, 1.0), (0.3, 0, 0.5, 1.5), (0.9, 2000, 0.9, 1.0)]  # fmt: skip


@pytest.mark.parametrize("vocab,vocab_limit,chunk,candidates", [(1000, 990, 128, 8), (777, None, 256, 16)])
def test_draw_equals_the_sorted_reference_on_every_path(vocab, vocab_limit, chunk, candidates):
    gen = torch.Generator().manual_seed(vocab)
    scratch = SampleScratch(vocab, DEVICE, chunk=chunk, candidates=candidates)
    for trial in range(2 * len(PARAMS)):
        scale = 0.5 + 6 * float(torch.rand(1, generator=gen))
        logits = (torch.randn(vocab, generator=gen) * scale).to(DEVICE)
        seen = (torch.rand(vocab, generator=gen) < 0.05).to(DEVICE)
        params = PARAMS[trial % len(PARAMS)]
        got, want, kept = run(logits, seen, params, scratch, seed=trial, pos=trial, vocab_limit=vocab_limit)
        assert got == want, f"{params}: drew {got}, the reference {want} (of {kept} kept)"
        assert got < (vocab_limit or vocab)
    counts = scratch.path_counts()
    assert all(counts[path] > 0 for path in SAMPLE_PATHS), counts


def test_a_top_k_wider_than_the_candidates_above_t_takes_one_pass():
    # 8 chunks of 128 with 8 candidates each: about 20 tokens lie above T. A top_k of 40 or 60 reaches into the
    # band bounded by the candidates' k-th key; 300 is more than all 64 candidates: the band is everything
    # up to T. With top_p, draws below F's top also come from the band.
    vocab = 1000
    gen = torch.Generator().manual_seed(8)
    scratch = SampleScratch(vocab, DEVICE, chunk=128, candidates=8)
    settings = [(1.0, 40, 1.0, 1.0), (1.5, 60, 0.9, 1.2), (1.0, 300, 1.0, 1.0), (2.0, 300, 0.8, 1.0)]
    for step in range(8):
        logits = (torch.randn(vocab, generator=gen) * 2).to(DEVICE)
        seen = (torch.rand(vocab, generator=gen) < 0.05).to(DEVICE)
        params = settings[step % len(settings)]
        got, want, kept = run(logits, seen, params, scratch, seed=step, pos=step, vocab_limit=990)
        assert got == want, f"{params}: drew {got}, the reference {want} (of {kept} kept)"
    counts = scratch.path_counts()
    assert counts["vocabulary pass"] == 8 and counts["redraws"] > 0, counts


def test_draws_outside_the_nucleus_are_drawn_again_from_the_candidates_or_the_vocabulary():
    # a flat distribution and top_p 0.5: the whole-vocabulary draw misses the nucleus about half the time
    vocab = 900
    gen = torch.Generator().manual_seed(5)
    # every token a candidate (chunks of C); 4 candidates a chunk of 128: most draws fall below T
    for chunk, candidates, path, steps in ((128, 128, "nucleus", 10), (128, 4, "vocabulary pass", 5)):
        scratch = SampleScratch(vocab, DEVICE, chunk=chunk, candidates=candidates)
        for step in range(10):
            logits = (torch.randn(vocab, generator=gen) * 0.3).to(DEVICE)
            seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
            got, want, kept = run(logits, seen, (1.0, 0, 0.5, 1.0), scratch, seed=3, pos=step)
            assert got == want and kept > 100
        counts = scratch.path_counts()
        assert counts[path] >= steps and counts["redraws"] >= 3, counts


def test_a_sharp_nucleus_draws_only_inside_it_and_a_seed_repeats():
    # probabilities 0.5, 0.3, 0.15, then 0.05 spread over the rest: top_p 0.9 keeps exactly three tokens
    vocab = 600
    probs = torch.full((vocab,), 0.05 / (vocab - 3))
    top = torch.tensor([17, 401, 250])
    probs[top] = torch.tensor([0.5, 0.3, 0.15])
    logits = probs.log().to(DEVICE)
    scratch = SampleScratch(vocab, DEVICE, chunk=64, candidates=4)
    draws = []
    for step in range(24):
        seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
        got, want, kept = run(logits, seen, (1.0, 0, 0.9, 1.0), scratch, seed=99, pos=step)
        assert kept == 3 and got == want and got in top.tolist()
        draws.append(got)
    assert len(set(draws)) > 1  # the noise changes with the position
    again = [
        run(logits, torch.zeros_like(seen), (1.0, 0, 0.9, 1.0), scratch, seed=99, pos=s)[0] for s in range(24)
    ]
    assert again == draws
    assert scratch.path_counts()["nucleus"] == 48


def test_every_token_a_candidate_and_ties_go_to_the_first_index():
    vocab = 48  # 3 chunks of 16, 16 candidates each: the whole vocabulary is sorted
    scratch = SampleScratch(vocab, DEVICE, chunk=16, candidates=16)
    logits = torch.linspace(-3, 3, vocab).to(DEVICE)
    seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    got, want, kept = run(logits, seen, (5.0, 0, 0.999, 1.0), scratch)
    assert got == want and kept > 40 and scratch.path_counts()["nucleus"] == 1
    tied = torch.zeros(vocab, device=DEVICE)
    tied[[30, 9, 41]] = 4.0
    for penalty in (1.0, 2.0):  # greedy; with a penalty the seen token 9 drops out of the tie
        seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
        seen[9] = penalty != 1.0
        got, _, _ = run(tied, seen, (0.0, 0, 1.0, penalty), scratch)
        assert got == (9 if penalty == 1.0 else 30)


def test_draws_follow_the_softmax_over_the_nucleus():
    # 6 tokens hold 0.72 of the mass (the first 5: 0.63) and top_p is 0.68: about 3 draws in 10 start outside
    vocab, nucleus = 64, [3, 17, 22, 40, 51, 60]
    lg = torch.full((vocab,), -1.0)
    lg[nucleus] = torch.tensor([2.6, 2.4, 2.2, 2.0, 1.9, 1.9])
    want = lg.double().softmax(0)[nucleus]
    assert want.sum() > 0.71 and want[:-1].sum() < 0.64
    want /= want.sum()
    scratch = SampleScratch(vocab, DEVICE, chunk=16, candidates=4)
    params, seed = torch.tensor([1.0, 0, 0.68, 1.0], device=DEVICE), ints(11, dtype=torch.int64)
    seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    draws = 4000 if DEVICE.type == "cuda" else 250
    token, pos, out_tokens = ints(0), ints(0), ints(*([0] * (draws + 2)))
    for _ in range(draws):
        sample_token(lg.to(DEVICE), seen, params, seed, scratch, token=token, pos=pos, out_tokens=out_tokens)
        seen.zero_()
    got = out_tokens[1 : draws + 1].cpu()
    assert set(got.tolist()) <= set(nucleus)
    freq = torch.tensor([(got == t).sum().item() for t in nucleus], dtype=torch.float64) / draws
    chi2 = (draws * (freq - want) ** 2 / want).sum().item()
    assert chi2 < 20.5, (freq, want)  # 5 degrees of freedom, p = 0.001
    assert scratch.path_counts()["redraws"] > draws // 10


def test_the_token_lands_in_the_host_ring():
    vocab = 300
    scratch = SampleScratch(vocab, DEVICE, chunk=128, candidates=8)
    ring = torch.full((16,), -1, dtype=torch.int32, pin_memory=DEVICE.type == "cuda")
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)
    seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    for pos in (14, 15):  # slots 15 and 0
        got, want, _ = run(logits, seen, (0.8, 0, 0.95, 1.0), scratch, pos=pos, ring=ring)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert got == want and ring[(pos + 1) % 16].item() == got


def test_the_noise_is_gumbel_and_the_race_draws_from_the_softmax():
    seed, pos = ints(7, dtype=torch.int64), ints(0)
    noise = gumbel_noise(seed, pos, 4096, steps=64).double().cpu()  # [64 positions, 4096 tokens]
    assert abs(noise.mean().item() - 0.5772) < 0.02  # Euler's constant
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.05
    assert abs(torch.corrcoef(noise[:2])[0, 1].item()) < 0.05  # positions draw independently
    # the race over 8 tokens at 64 * 512 = 32,768 (position, token block) draws
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0, 0.5, 1.5, -2.0], dtype=torch.float64)
    wins = (logits + noise.reshape(-1, 8)).argmax(1)
    freq = torch.bincount(wins, minlength=8) / wins.numel()
    expected = logits.softmax(0)
    chi2 = (wins.numel() * (freq - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001


def test_every_int64_seed_draws_its_own_noise_and_repeats_it():
    # The API takes any int64 seed and the runner passes it on as is: the ends, -1 and 0 must not share a stream.
    pos = ints(3)
    seeds = (-(2**63), -1, 0, 1, 2**63 - 1)
    noise = [gumbel_noise(ints(seed, dtype=torch.int64), pos, 256).cpu() for seed in seeds]
    assert all(n.isfinite().all() for n in noise)
    assert len({tuple(n.flatten().tolist()) for n in noise}) == len(seeds)
    assert torch.equal(gumbel_noise(ints(-1, dtype=torch.int64), pos, 256).cpu(), noise[1])


def test_rejects_what_it_cannot_sample():
    vocab = 64
    scratch = SampleScratch(vocab, DEVICE, chunk=16, candidates=4)
    logits = torch.zeros(vocab, device=DEVICE)
    seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    params, seed = torch.ones(4, device=DEVICE), ints(1, dtype=torch.int64)
    kw = dict(token=ints(0), pos=ints(0), out_tokens=ints(0, 0))
    with pytest.raises(ValueError, match="logits"):
        sample_token(logits.half(), seen, params, seed, scratch, **kw)
    with pytest.raises(ValueError, match="seen"):
        sample_token(logits, seen.int(), params, seed, scratch, **kw)
    with pytest.raises(ValueError, match="seed"):
        sample_token(logits, seen, params, seed.int(), scratch, **kw)
    with pytest.raises(ValueError, match="scratch"):
        sample_token(torch.zeros(2 * vocab, device=DEVICE), torch.zeros(2 * vocab, dtype=torch.bool, device=DEVICE),
                     params, seed, scratch, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="candidates"):
        SampleScratch(vocab, DEVICE, candidates=6)
    with pytest.raises(ValueError, match="chunk"):
        SampleScratch(vocab, DEVICE, chunk=8, candidates=16)
