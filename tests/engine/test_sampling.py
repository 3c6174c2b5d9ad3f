import pytest
import torch

from common.events import InvalidRequest, SamplingParams
from inference.sampling import Sampler


def draws(params, logits, n, history=()):
    sampler = Sampler(params)
    return [sampler(logits, list(history)) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=gen).to(dtype)
        # A seed does not make greedy random.
        assert Sampler(SamplingParams(temperature=0, seed=5))(logits, []) == int(logits.float().argmax())


def test_top_k_restricts_support():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(logits, 3).indices.tolist())
    seen = set(draws(SamplingParams(temperature=2.0, top_k=3, seed=0), logits, 3000))
    assert seen == allowed  # never outside, and at high temperature every allowed token shows up


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for top_p, allowed in [(0.4, {0}), (0.8, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})]:
        assert set(draws(SamplingParams(temperature=1.0, top_p=top_p, seed=0), logits, 3000)) == allowed


def test_top_k_then_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top-k leaves 0.4/0.3/0.2 (renormalised to .44/.33/.22); top_p 0.6 then keeps the first two.
    seen = set(draws(SamplingParams(temperature=1.0, top_k=3, top_p=0.6, seed=0), logits, 2000))
    assert seen == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_frequencies(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    counts = torch.bincount(
        torch.tensor(draws(SamplingParams(temperature=temperature, seed=3), logits, n)), minlength=4
    )
    expected = torch.softmax(logits / temperature, -1)
    assert torch.allclose(counts / n, expected, atol=0.015)


def test_repetition_penalty_hf_semantics():
    penalty = SamplingParams(repetition_penalty=2.0)
    # Positive logits are divided: 2.0 -> 1.0 falls below the unseen 1.5.
    assert Sampler(penalty)(torch.tensor([2.0, 1.5, -9.0]), [0]) == 1
    assert Sampler(SamplingParams())(torch.tensor([2.0, 1.5, -9.0]), [0]) == 0
    # Negative logits are multiplied: -1.0 -> -2.0 falls below the unseen -1.5.
    assert Sampler(penalty)(torch.tensor([-1.0, -1.5, -9.0]), torch.tensor([0, 0])) == 1
    # A penalty below 1 favours seen tokens.
    assert Sampler(SamplingParams(repetition_penalty=0.5))(torch.tensor([1.0, 1.5, -9.0]), [0]) == 0


def test_repetition_penalty_matches_transformers():
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        logits = torch.randn(1, 64, generator=gen)
        history = logits[0].topk(3).indices[None]  # penalise the favourites so the choice changes
        theirs = transformers.RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
        assert Sampler(SamplingParams(repetition_penalty=1.3))(logits[0], history[0]) == int(theirs.argmax())


def test_seed_reproducible():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    first = draws(params, logits, 100)
    assert first == draws(params, logits, 100)
    assert first != draws(SamplingParams(temperature=1.0, top_p=0.95, seed=1235), logits, 100)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-308),  # would overflow the logits it divides
        ("repetition_penalty", 1e4),
        ("max_new_tokens", 0),
        ("seed", "7"),
        ("seed", 2**63),  # past an int64, where torch would take it as -2**63's twin
        ("seed", -(2**63) - 1),
    ],
)
def test_invalid_params_raise_invalid_request(field, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_a_temperature_too_small_to_divide_by_is_served_greedily():
    logits = torch.tensor([30.0, 29.9, -5.0])
    for tiny in (1e-40, 1e-6):
        params = SamplingParams(temperature=tiny)
        assert params.greedy and Sampler(params)(logits, []) == 0  # not a NaN from logits / 1e-40
    assert not SamplingParams(temperature=1e-5).greedy
    edges = SamplingParams(seed=2**63 - 1, repetition_penalty=1e-3), SamplingParams(seed=-(2**63))
    assert all(Sampler(p)(logits, [0]) in (0, 1, 2) for p in edges)  # the generator takes both ends
