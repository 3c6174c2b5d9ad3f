import pytest
import torch

from kernels.lm_head import HeadScratch, lm_head
from kernels.lm_head_screen import TAIL_BITS, HeadScreen, ScreenScratch, screened_argmax, screened_logits
from kernels.sample import SampleScratch, sample_token
from tests.support.kernels import DEVICE, ON_GPU, device_ints, dtype_params, randn, reference_logits


def screened_token(x, w, g=None, vocab_limit=None, **kwargs):
    """(token, scratch, screen) of one screened launch from position 4."""
    screen, scratch = HeadScreen.build(w), ScreenScratch(w.shape[0], DEVICE)
    token, pos, out_tokens = device_ints(-1), device_ints(4), device_ints(*([-1] * 8))
    screened_argmax(x, w, screen, scratch, token=token, pos=pos, out_tokens=out_tokens, norm_weight=g, eps=1e-5,
                    vocab_limit=vocab_limit, **kwargs)  # fmt: skip
    assert pos.item() == 5 and out_tokens.cpu().tolist() == [-1] * 5 + [token.item()] + [-1] * 2
    assert (scratch.head.counter == 0).all(), "arrival counters must return to zero for the next step"
    return token.item(), scratch, screen


def full_head_token(x, w, g=None, vocab_limit=None):
    logits = torch.empty(w.shape[0], dtype=torch.float32, device=DEVICE)
    token, pos, out_tokens = device_ints(-1), device_ints(0), device_ints(-1, -1)
    lm_head(x, w, logits, HeadScratch(w.shape[0], DEVICE), norm_weight=g, eps=1e-5, token=token, pos=pos,
            out_tokens=out_tokens, vocab_limit=vocab_limit)  # fmt: skip
    return token.item()


@pytest.mark.parametrize("dtype", dtype_params())
# (vocab, K): K over one tile and under (and not whole int32 words of int8); a vocabulary that leaves the last
# program short; a K longer than 2048
@pytest.mark.parametrize("vocab,k", [(1000, 256), (777, 202), (131, 2304)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_screen_picks_the_full_heads_token(dtype, vocab, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = randn(k, scale=2.0, gen=gen)
    w = randn(vocab, k, dtype=dtype, scale=k**-0.5, gen=gen)
    g = randn(k, dtype=dtype, gen=gen)
    limit = vocab - 7  # padded rows past the tokenizer's vocabulary are never chosen
    token, scratch, screen = screened_token(x, w, g, vocab_limit=limit)
    assert token == full_head_token(x, w, g, vocab_limit=limit)
    exact = reference_logits(x, w, g, 1e-5)
    # every row's upper bound holds its exact logit, and no lower bound passes the largest one
    hi = scratch.hi[:vocab].double().cpu()
    assert (hi[:limit] >= exact[:limit]).all()
    assert (hi[limit:] == float("-inf")).all()
    assert scratch.floor().item() <= exact[:limit].max().item()
    # random rows: the screen leaves a handful of candidates (of 131 rows or of hundreds)
    assert 1 <= scratch.candidates(vocab) <= max(12, vocab // 20)


@pytest.mark.parametrize("slice_rows,cap", [(64, 8), (16, 2), (256, 4)])
def test_ties_and_all_candidates_take_the_first_row(slice_rows, cap):
    """x = 0 makes every logit 0: every row is a candidate, in rounds of `cap` a slice, and row 0 wins; then a
    row repeated at 7, 40 and 170 (three slices) wins at 7."""
    vocab, k = 200, 48
    w = randn(vocab, k, scale=0.1)
    token, scratch, _ = screened_token(torch.zeros(k, device=DEVICE), w, slice_rows=slice_rows, cap=cap)
    assert token == 0
    x = randn(k)
    best = torch.sign(x) * 2
    for row in (170, 40, 7):
        w[row] = best
    token, _, _ = screened_token(x, w, slice_rows=slice_rows, cap=cap)
    assert token == 7


def test_outliers_widen_the_screen_but_never_change_the_token():
    """Rows with one huge weight (against an x of 0 there) keep few int8 levels for the rest, and one huge element
    of x takes most of its integer levels: the bounds grow, more rows are read again, and the token stays the full
    head's, even where it wins by a hair over a row whose copy is exact to 1%."""
    vocab, k = 500, 128
    gen = torch.Generator().manual_seed(5)
    w = randn(vocab, k, scale=k**-0.5, gen=gen)
    x = randn(k, gen=gen)
    x[3], x[9] = 0.0, 300.0
    w[300] = torch.sign(x) * 0.5
    w[20] = w[300]
    w[:50, 3] = 40.0
    w[20, 9] += 1e-5  # +3e-3 on a logit of ~200
    exact = reference_logits(x, w)
    token, scratch, screen = screened_token(x, w)
    assert token == int(exact.argmax()) == 20 == full_head_token(x, w)
    assert screen.e_norm[:50].min() > 10 * screen.e_norm[50:].max()
    assert scratch.candidates(vocab) >= 50


def test_the_screen_copy_and_its_norms():
    w = randn(33, 40)
    w[5] = 0  # an all-zero row keeps a scale of 1 and zero norms
    screen = HeadScreen.build(w, rows_at_a_time=8)
    back = screen.scale[:, None] * screen.q.float()
    err = (w.double() - back.double()).cpu()
    assert screen.q.dtype == torch.int8 and int(screen.q.abs().max()) == 127
    assert (err.abs() <= screen.scale.double().cpu()[:, None] / 2 + 1e-7).all()
    assert torch.allclose(screen.e_norm.double().cpu(), err.norm(dim=1), rtol=1e-5, atol=1e-9)
    assert torch.allclose(screen.q_norm.double().cpu(), back.double().cpu().norm(dim=1), rtol=1e-5)
    assert screen.scale[5].item() == 1.0 and screen.q_norm[5].item() == 0 == screen.e_norm[5].item()
    assert screen.nbytes == 33 * 40 + 3 * 33 * 4


def test_a_parameters_screen_keeps_no_autograd_graph():
    """A model's head is a Parameter: built under autograd, the screen's norms would hang on a graph holding every
    row block's float64 temporaries (~12 GB for qwen3-1.7b's head on the GPU)."""
    w = torch.nn.Parameter(randn(300, 64))
    screen = HeadScreen.build(w, rows_at_a_time=128)
    for t in (screen.q, screen.scale, screen.q_norm, screen.e_norm):
        assert not t.requires_grad and t.grad_fn is None


def test_the_host_ring_gets_the_token():
    vocab, k = 300, 64
    x, w = randn(k), randn(vocab, k)
    ring = torch.full((4,), -1, dtype=torch.int32, pin_memory=ON_GPU)
    token, _, _ = screened_token(x, w, host_ring=ring)
    assert ring.tolist() == [-1, token, -1, -1]  # position 4 -> token for position 5 -> slot 5 % 4


def sampled_head(x, w, g, seen, temperature, penalty, vocab_limit=None):
    """(lm_head's logits, the screened logits) for the sampler's settings (top_k 0, top_p 1)."""
    vocab = w.shape[0]
    params = torch.tensor([temperature, 0.0, 1.0, penalty], device=DEVICE)
    whole = torch.empty(vocab, dtype=torch.float32, device=DEVICE)
    lm_head(x, w, whole, HeadScratch(vocab, DEVICE), norm_weight=g, eps=1e-5, greedy=False)
    screened = torch.full((vocab,), float("nan"), device=DEVICE)
    screened_logits(x, w, HeadScreen.build(w), ScreenScratch(vocab, DEVICE), screened, seen=seen, params=params,
                    norm_weight=g, eps=1e-5, vocab_limit=vocab_limit)  # fmt: skip
    return whole, screened


def penalised(logits, seen, penalty):
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("temperature,penalty", [(0.2, 1.0), (0.05, 1.3), (0.1, 0.7), (0.0, 1.5)])
def test_the_sampled_screen_keeps_every_row_that_can_weigh_in_the_draw(dtype, temperature, penalty):
    """The rows it computes carry lm_head's own logits; the rows it leaves at -inf weigh under 2^-TAIL_BITS / V of
    the largest row's weight exp(l' / T) each (l' penalised where seen); at T = 0 the argmax is among the rows."""
    vocab, k = 1500, 256
    gen = torch.Generator().manual_seed(7)
    x = randn(k, scale=2.0, gen=gen)
    w = randn(vocab, k, dtype=dtype, scale=2 * k**-0.5, gen=gen)
    g = randn(k, dtype=dtype, gen=gen)
    whole, screened = sampled_head(x, w, g, torch.zeros(vocab, dtype=torch.bool, device=DEVICE), 1.0, 1.0)
    seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    seen[whole.topk(5).indices[::2]] = True  # the penalty moves the leaders (1st, 3rd, 5th)
    seen[whole.topk(5, largest=False).indices] = True
    limit = vocab - 3
    whole, screened = sampled_head(x, w, g, seen, temperature, penalty, vocab_limit=limit)
    assert not screened.isnan().any(), "every row is written"
    kept = screened > float("-inf")
    assert torch.equal(screened[kept], whole[kept]) and not kept[limit:].any()
    scored = penalised(whole[:limit].double(), seen[:limit], penalty)
    best = scored.max()
    assert kept[:limit][scored == best].all()
    if temperature > 0:
        # every row within T * (ln V + TAIL_BITS ln 2) of the best is kept; the screen keeps a few more
        reach = temperature * (
            torch.log(torch.tensor(float(vocab))) + TAIL_BITS * torch.log(torch.tensor(2.0))
        )
        assert kept[:limit][scored >= best - reach.item()].all()
        assert int(kept.sum()) < vocab // 2, "random rows: the screen leaves most of them out"


@pytest.mark.parametrize("slice_rows", [None, 16])
def test_the_host_ring_gets_each_steps_candidate_count(slice_rows):
    """candidate_ring[(pos + 1) % R] receives the rows the step read again (those whose logits are written), and
    the tally starts from zero at the next launch: a peaked input, a flat one, then the peaked one again."""
    vocab, k = 700, 64
    gen = torch.Generator().manual_seed(3)
    w = randn(vocab, k, scale=k**-0.5, gen=gen)
    peaked = 40.0 * w[123].float() / w[123].float().norm()  # row 123 far above the rest
    flat = torch.zeros(k, device=DEVICE)  # every logit 0: every row a candidate
    screen, scratch = HeadScreen.build(w), ScreenScratch(vocab, DEVICE)
    seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    params = torch.tensor([0.2, 0.0, 1.0, 1.0], device=DEVICE)
    ring = torch.full((4,), -1, dtype=torch.int32, pin_memory=ON_GPU)
    counts = []
    for step, x in enumerate((peaked, flat, peaked)):
        logits = torch.empty(vocab, dtype=torch.float32, device=DEVICE)
        screened_logits(x, w, screen, scratch, logits, seen=seen, params=params, candidate_ring=ring,
                        pos=device_ints(step + 5), slice_rows=slice_rows)  # fmt: skip
        if ON_GPU:
            torch.cuda.synchronize()
        counts.append(int(ring[(step + 6) % 4]))
        assert counts[-1] == int((logits > float("-inf")).sum())
        assert int(scratch.tally.item()) == 0
    assert counts[0] == counts[2] and 1 <= counts[0] < vocab // 10
    assert counts[1] == vocab
    assert ring[(5 + 0) % 4] == -1, "only the step's slots are written"


@pytest.mark.parametrize("temperature,top_p,penalty", [(0.2, 0.95, 1.0), (0.3, 1.0, 1.2), (0.0, 1.0, 1.3)])
def test_the_sampler_draws_the_same_tokens_from_the_screened_logits(temperature, top_p, penalty):
    vocab, k = 900, 128
    gen = torch.Generator().manual_seed(11)
    w = randn(vocab, k, scale=2 * k**-0.5, gen=gen)
    params = torch.tensor([temperature, 0.0, top_p, penalty], device=DEVICE)
    for step in range(6):
        x = randn(k, scale=2.0, gen=gen)
        seen = torch.rand(vocab, generator=gen).lt(0.1).to(DEVICE)
        whole, screened = sampled_head(x, w, None, seen, temperature, penalty)
        tokens = []
        for logits in (whole, screened):
            token, pos, out_tokens = device_ints(-1), device_ints(step), device_ints(*([-1] * 8))
            sample_token(logits, seen.clone(), params, torch.tensor([5], device=DEVICE), SampleScratch(vocab, DEVICE),
                         token=token, pos=pos, out_tokens=out_tokens)  # fmt: skip
            tokens.append(token.item())
        assert tokens[0] == tokens[1]


def test_bad_arguments_are_refused():
    vocab, k = 64, 32
    x, w = randn(k), randn(vocab, k)
    screen, scratch = HeadScreen.build(w), ScreenScratch(vocab, DEVICE)
    token, pos, out_tokens = device_ints(0), device_ints(0), device_ints(0, 0)
    common = {"token": token, "pos": pos, "out_tokens": out_tokens}
    with pytest.raises(ValueError, match="screen: built for"):
        screened_argmax(x, w, HeadScreen.build(randn(vocab + 1, k)), scratch, **common)
    with pytest.raises(ValueError, match="x: expected"):
        screened_argmax(randn(k + 1), w, screen, scratch, **common)
    with pytest.raises(ValueError, match="scratch"):
        screened_argmax(x, w, screen, ScreenScratch(vocab - 1, DEVICE), **common)
    with pytest.raises(ValueError, match="powers of two"):
        screened_argmax(x, w, screen, scratch, slice_rows=48, **common)
    with pytest.raises(ValueError, match="token"):
        screened_argmax(x, w, screen, scratch, token=device_ints(0, 0), pos=pos, out_tokens=out_tokens)
    with pytest.raises(ValueError, match="weight"):
        HeadScreen.build(randn(4, 5, 6))
    logits, seen = torch.empty(vocab, device=DEVICE), torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    params = torch.tensor([0.2, 0.0, 1.0, 1.0], device=DEVICE)
    with pytest.raises(ValueError, match="logits: expected"):
        screened_logits(x, w, screen, scratch, logits[:-1], seen=seen, params=params)
    with pytest.raises(ValueError, match="seen: expected"):
        screened_logits(x, w, screen, scratch, logits, seen=seen.int(), params=params)
    with pytest.raises(ValueError, match="params: expected"):
        screened_logits(x, w, screen, scratch, logits, seen=seen, params=params.double())
    ring = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="candidate_ring"):
        screened_logits(x, w, screen, scratch, logits, seen=seen, params=params, candidate_ring=ring)
    with pytest.raises(ValueError, match="candidate_ring"):
        screened_logits(x, w, screen, scratch, logits, seen=seen, params=params, candidate_ring=ring.long(),
                        pos=pos)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="a real head's shape, compiled")
def test_a_real_heads_shape_in_bf16():
    vocab, k = 128256, 2048
    gen = torch.Generator().manual_seed(3)
    w = randn(vocab, k, dtype=torch.bfloat16, scale=0.02, gen=gen)
    g = randn(k, dtype=torch.bfloat16, gen=gen)
    for seed in range(5):
        x = randn(k, scale=3.0, gen=torch.Generator().manual_seed(10 + seed))
        token, scratch, _ = screened_token(x, w, g, vocab_limit=128000, slice_rows=512)
        assert token == full_head_token(x, w, g, vocab_limit=128000)
        assert scratch.candidates(vocab) < 1000
