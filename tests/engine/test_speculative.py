"""Speculative decoding is exact: the same greedy tokens, the same seeded tokens, the model's distribution."""

import math
from collections import Counter
from dataclasses import replace

import pytest

from common.env import EnvError
from common.events import Done, SamplingParams, TextDelta
from inference import runner as runner_module
from inference.bench.workload import WORKLOAD
from inference.config import ModelConfig
from inference.engine import Engine
from inference.presets import preset_config
from inference.runner import ReferenceRunner
from inference.speculative import DraftLength, SpeculationSettings, StepClock, SuffixDrafter, accept
from inference.synth import peaked_model
from tests.support import e2e_model

ON, OFF = SpeculationSettings(enabled=True, max_draft=8), SpeculationSettings(enabled=False)


def runners(engine: Engine) -> tuple[ReferenceRunner, ReferenceRunner]:
    make = lambda s: ReferenceRunner(engine.model, engine.max_context, engine.tokenizer.vocab_size, s)  # noqa: E731
    return make(ON), make(OFF)


# --- the pieces ----------------------------------------------------------------------------------------------


def test_drafter_copies_after_the_longest_most_recent_match():
    drafter = SuffixDrafter([1, 2, 3, 9, 2, 3, 7, 8, 5, 2, 3])
    # the suffix (2, 3) occurred twice: the latest one, followed by 7 8 5; (5, 2, 3) never did before
    assert drafter.draft(3) == [7, 8, 5]
    drafter.extend([7])
    assert drafter.draft(2) == [8, 5]  # (2, 3, 7) is the longest match now
    assert drafter.draft(0) == []
    drafter.extend([4])
    assert drafter.draft(4) == []  # 4 never occurred before


def test_drafter_draft_may_run_into_the_suffix_itself():
    drafter = SuffixDrafter([5, 6, 5, 6, 5, 6])
    assert drafter.draft(5) == [5, 6]  # what followed the latest earlier (.., 5, 6), up to the context's end


def test_a_prediction_is_drafted_from_first_and_in_order():
    # the context's own (2, 3) was followed by 7 5; the prediction's first (2, 3) by 4 4, and it wins
    drafter = SuffixDrafter([9, 2, 3, 7, 5, 2, 3], prediction=[2, 3, 4, 4, 2, 3, 6])
    assert drafter.draft(2) == [4, 4] and drafter.from_prediction
    drafter.extend([4, 4, 2, 3])
    assert drafter.draft(3) == [6]  # the prediction's end: what follows it is not known
    drafter.extend([8, 1])
    assert drafter.draft(2) == []  # (8, 1) and (1) occur nowhere


def test_drafts_walk_through_a_prediction_where_the_reply_is_in_it():
    drafter = SuffixDrafter([0, 1, 2], prediction=[1, 2, 5, 1, 2, 6, 1, 2])
    assert drafter.draft(1) == [5]  # (1, 2)'s first occurrence: a prediction's end has no token after it
    drafter.extend([7, 1, 2])  # 3 tokens on from that draft's start: the occurrence there, not the first
    assert drafter.draft(1) == [6]
    drafter.extend([9, 1, 2])  # none is left at or past where the reply would be: the latest again
    assert drafter.draft(1) == [6]
    # a repeated line: after a long accepted draft the walk goes on from where the reply is, not back to the first
    line = [4, 5, 6, 7]
    drafter = SuffixDrafter([0, 4, 5], prediction=[*line, 8, *line, 9])
    assert drafter.draft(8) == [6, 7, 8, 4, 5, 6, 7, 9]
    drafter.extend([6, 7, 8, 4, 5])
    assert drafter.draft(2) == [6, 7] and drafter.draft(3) == [6, 7, 9]
    # the context is searched where the prediction has no match
    drafter = SuffixDrafter([3, 4, 8, 3, 4], prediction=[1, 2])
    assert drafter.draft(1) == [8] and not drafter.from_prediction


def test_draft_length_grows_shrinks_and_pauses():
    length = DraftLength(max_draft=8)
    assert length.next() == 4
    length.update(4, 4)
    assert length.next() == 8
    length.update(8, 8)
    assert length.next() == 8  # capped
    length.update(8, 3)
    assert length.next() == 3
    length.update(3, 0)  # wholly rejected: one step without a draft, then k = 1
    assert [length.next(), length.next()] == [0, 1]
    length.update(1, 0)  # again: the pause doubles
    assert [length.next(), length.next(), length.next()] == [0, 0, 1]
    length.update(1, 1)
    assert length.next() == 2
    length.update(2, 2, cost=1.5)  # 3 tokens for 1.5 steps' time: worth it
    assert length.next() == 4
    length.update(4, 1, cost=2.5)  # 2 tokens for 2.5 steps' time: slower than plain, so a pause
    assert [length.next(), length.next()] == [0, 1]


def test_step_clock_prices_a_verify_step_in_plain_steps():
    clock = StepClock()
    assert clock.cost(0.5) == 1.0  # nothing to compare with yet
    clock.plain(0.010)
    clock.plain(0.010)
    assert clock.cost(0.025) == pytest.approx(2.5)


def test_accept_stops_at_the_first_disagreement_and_at_a_stop_id():
    chosen = iter([7, 8, 1, 4])
    assert accept([7, 8, 9], lambda j: next(chosen)) == [7, 8, 1]
    assert accept([7, 8], lambda j: [7, 8, 6][j]) == [7, 8, 6]  # all accepted: the token after the draft too
    assert accept([0, 8], lambda j: [0, 8, 6][j], stop_ids=frozenset({0})) == [0]


def test_settings_from_env(monkeypatch):
    monkeypatch.delenv("KOG_SPECULATIVE", raising=False)
    monkeypatch.delenv("KOG_DRAFT_MAX", raising=False)
    assert SpeculationSettings.from_env() == SpeculationSettings(enabled=True, max_draft=8)
    monkeypatch.setenv("KOG_SPECULATIVE", "0")
    monkeypatch.setenv("KOG_DRAFT_MAX", "16")
    assert SpeculationSettings.from_env() == SpeculationSettings(enabled=False, max_draft=16)
    monkeypatch.setenv("KOG_SPECULATIVE", "maybe")
    with pytest.raises(EnvError, match="KOG_SPECULATIVE"):
        SpeculationSettings.from_env()
    monkeypatch.setenv("KOG_SPECULATIVE", "1")
    monkeypatch.setenv("KOG_DRAFT_MAX", "0")
    with pytest.raises(EnvError, match="KOG_DRAFT_MAX"):
        SpeculationSettings.from_env()


# --- exactness on every family -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny-laneformer", "tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def tiny(request):
    return Engine.load(request.param, device="cpu")


def copy_prompt(engine: Engine) -> list[int]:
    """A prompt that holds its own greedy continuation: the drafts are long and mostly right. 150 tokens and
    200 more cross tiny-laneformer's 64-token windows many times, in prefill and in verify steps alike."""
    base = [(7 * i + 3) % 500 + 20 for i in range(60)]
    _, off = runners(engine)
    continuation = list(off.generate_tokens(base, SamplingParams(max_new_tokens=30, temperature=0)))
    return base + continuation + base


def test_greedy_identical_with_and_without_drafts(tiny):
    on, off = runners(tiny)
    prompt = copy_prompt(tiny)
    params = SamplingParams(max_new_tokens=200, temperature=0)
    assert list(on.generate_tokens(prompt, params)) == list(off.generate_tokens(prompt, params))
    counts = on.counts
    # it did speculate: verify steps ran, with accepted and rejected drafts both
    assert 0 < counts.draft_n_accepted < counts.draft_n and counts.decode_steps < 199


@pytest.fixture(scope="module", params=["tiny-laneformer", "tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def peaked(request):
    """synth's peaked model of the preset (two likely successors per token, as a trained model's margins), with
    a prompt that is its own greedy chain: sampled runs revisit it, so drafts are proposed and often accepted."""
    model = peaked_model(ModelConfig.from_hf(preset_config(request.param)), seed=0).requires_grad_(False)
    on, off = ReferenceRunner(model, 512, None, ON), ReferenceRunner(model, 512, None, OFF)
    base = [5, 17, 300]
    prompt = base + list(off.generate_tokens(base, SamplingParams(max_new_tokens=60, temperature=0)))
    return on, off, prompt


def test_seeded_sampling_identical_with_and_without_drafts(peaked):
    on, off, prompt = peaked
    drafted = accepted = 0
    for seed in range(6):
        params = SamplingParams(
            max_new_tokens=40, temperature=0.6, top_p=0.95, repetition_penalty=1.05, seed=seed
        )
        assert list(on.generate_tokens(prompt, params)) == list(off.generate_tokens(prompt, params))
        drafted, accepted = drafted + on.counts.draft_n, accepted + on.counts.draft_n_accepted
    assert 0 < accepted < drafted  # drafts were accepted and rejected


def chi_square_upper(df: int, z: float = 3.29) -> float:
    """The chi-square quantile z standard deviations up (3.29: p = 0.0005), by Wilson and Hilferty."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic for two equal-sized samples, values seen fewer than 10 times pooled; and its cells."""
    pooled_a = pooled_b = 0
    statistic, cells = 0.0, 0
    for value in a.keys() | b.keys():
        if a[value] + b[value] < 10:
            pooled_a, pooled_b = pooled_a + a[value], pooled_b + b[value]
        else:
            statistic, cells = statistic + (a[value] - b[value]) ** 2 / (a[value] + b[value]), cells + 1
    if pooled_a + pooled_b:
        statistic, cells = statistic + (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b), cells + 1
    return statistic, cells


def test_sampled_output_keeps_the_models_distribution(monkeypatch):
    """The first three sampled tokens, with drafts, against the plain sampler under other seeds: a two-sample
    chi-square over their joint values stays under its p = 0.0005 bound; a rule that accepts every draft
    (wrong) goes over it, so the bound can tell."""
    model = peaked_model(ModelConfig.from_hf(preset_config("tiny-llama")), seed=0).requires_grad_(False)
    on, off = ReferenceRunner(model, 512, None, ON), ReferenceRunner(model, 512, None, OFF)
    base = [5, 17, 300]
    prompt = base + list(off.generate_tokens(base, SamplingParams(max_new_tokens=60, temperature=0)))
    params = SamplingParams(max_new_tokens=3, temperature=2.0, top_k=3)
    n, drafted, accepted = 600, 0, 0

    def sample(runner, seeds):
        return Counter(tuple(runner.generate_tokens(prompt, replace(params, seed=s))) for s in seeds)

    plain = sample(off, range(n))
    drafts = Counter()
    for s in range(n, 2 * n):
        drafts[tuple(on.generate_tokens(prompt, replace(params, seed=s)))] += 1
        drafted, accepted = drafted + on.counts.draft_n, accepted + on.counts.draft_n_accepted
    assert (
        0.1 * drafted < accepted < 0.9 * drafted and drafted > n / 2
    )  # both branches of the rule, many times
    statistic, cells = two_sample_chi_square(plain, drafts)
    assert cells >= 5
    assert statistic < chi_square_upper(cells - 1)

    def accept_every_draft(draft, sample_at, stop_ids=frozenset()):
        for j in range(len(draft)):
            sample_at(j)  # draws the position's uniform, then is overruled
        return [*draft, sample_at(len(draft))]

    monkeypatch.setattr(runner_module, "accept", accept_every_draft)
    statistic, cells = two_sample_chi_square(plain, sample(on, range(2 * n, 3 * n)))
    assert statistic > chi_square_upper(cells - 1)


# --- the workload, on the default model, through the engine ---------------------------------------------------


@pytest.fixture(scope="module")
def default_engines():
    engine = Engine.load(e2e_model(), device="cpu")
    plain = Engine.load(e2e_model(), device="cpu")
    plain.runner.speculation = OFF
    assert engine.runner.speculation.enabled  # on by default
    return engine, plain


def test_a_prediction_changes_no_token_and_is_drafted_from(default_engines):
    """OpenAI's Predicted Outputs: the reply itself as the prediction makes most of its tokens accepted drafts;
    a wrong prediction costs nothing but rejected drafts; the tokens are the model's either way."""
    engine, plain = default_engines
    ids = engine.encode_prompt(WORKLOAD[-1].text)
    params = SamplingParams(max_new_tokens=48, temperature=0)
    reply = list(plain.generate(ids, params))[-1]
    tokens = lambda events: [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]  # noqa: E731
    expected = tokens(plain.generate(ids, params))
    without = list(engine.generate(ids, params))
    right = list(engine.generate(ids, replace(params, prediction=reply.text)))
    wrong = list(engine.generate(ids, replace(params, prediction="zebra " * 40)))
    assert tokens(without) == tokens(right) == tokens(wrong) == expected
    assert right[-1].text == without[-1].text == reply.text
    accepted = lambda events: events[-1].stats.draft_n_accepted  # noqa: E731
    assert accepted(right) > accepted(without) and accepted(right) >= 0.75 * (len(expected) - 1)
    assert right[-1].stats.decode_steps < without[-1].stats.decode_steps
    # the drafts taken from the prediction, counted apart (the API's usage reports them)
    stats = right[-1].stats
    assert stats.prediction_tokens > 0 and 0.5 * (
        len(expected) - 1
    ) <= stats.prediction_draft_n_accepted <= accepted(right)
    assert stats.prediction_draft_n_accepted <= stats.prediction_draft_n <= stats.draft_n
    assert (without[-1].stats.prediction_tokens, without[-1].stats.prediction_draft_n) == (0, 0)
    assert wrong[-1].stats.prediction_tokens > 0 and wrong[-1].stats.prediction_draft_n_accepted == 0


@pytest.mark.parametrize("prompt", WORKLOAD, ids=[p.name for p in WORKLOAD])
def test_workload_greedy_identical_on_the_default_model(default_engines, prompt):
    engine, plain = default_engines
    ids = engine.encode_prompt(prompt.text)
    params = SamplingParams(max_new_tokens=64, temperature=0)
    with_drafts, without = list(engine.generate(ids, params)), list(plain.generate(ids, params))
    tokens = lambda events: [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]  # noqa: E731
    assert tokens(with_drafts) == tokens(without)
    assert with_drafts[-1].text == without[-1].text
    done, plain_done = with_drafts[-1], without[-1]
    assert isinstance(done, Done) and done.stats.draft_n_accepted <= done.stats.draft_n
    assert (
        plain_done.stats.draft_n == 0
        and plain_done.stats.decode_steps == plain_done.stats.completion_tokens - 1
    )
    # every token after the first came from a step: plain ones one each, verify steps 1 + accepted each
    stats = done.stats
    assert stats.completion_tokens - 1 <= stats.decode_steps + stats.draft_n_accepted


def test_the_workload_rows_time_plain_drafted_and_predicted_decoding_of_the_same_tokens():
    from inference.bench.speculative import run_workload

    rows = run_workload(e2e_model(), "cpu", max_tokens=12, repeats=1)
    assert [row["prompt"] for row in rows] == [prompt.name for prompt in WORKLOAD]
    for row in rows:
        assert (
            row["identical"] and min(row["plain_tok_s"], row["speculative_tok_s"], row["predicted_tok_s"]) > 0
        )
        assert row["predicted_draft_n_accepted"] <= row["predicted_draft_n"]
    # the reply as its own prediction: most of its tokens come as accepted drafts
    assert sum(r["predicted_draft_n_accepted"] for r in rows) > sum(r["draft_n_accepted"] for r in rows)
