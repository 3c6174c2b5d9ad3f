"""Speculative decoding on the fast runner (its kernels under Triton's interpreter on the CPU) is exact: the verify
step's rows are the plain steps' logits, and a generation gives the same tokens with drafts as without, greedy and
seeded, across sliding windows, the Laneformer's delayed reductions and lane groups. The prompts are chosen so
that some drafts are accepted and some rejected (each test checks it did)."""

import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from common.events import Done, SamplingParams
from inference.config import ModelConfig
from inference.engine import Engine
from inference.fast import prefill
from inference.fast.runner import FastRunner
from inference.fast.settings import RunnerSettings
from inference.model import Transformer
from inference.presets import preset_config
from inference.speculative import SpeculationSettings
from kernels.skinny_matmul import MAX_ROWS, skinny_linear
from tests.engine.test_fast_runner import ALL_PACKED, bf16_valued, make_model
from tests.support import ROOT
from tests.support.kernels import DEVICE, ON_GPU

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
ON, OFF = SpeculationSettings(enabled=True, max_draft=4), SpeculationSettings(enabled=False)


def model_of(preset: str) -> Transformer:
    model = Transformer(ModelConfig.from_hf(preset_config(preset)), device=DEVICE, dtype=DTYPE)
    model.init_weights(std=0.05, generator=torch.Generator(device=DEVICE).manual_seed(0))
    return model.eval()


def copying_prompt(seed: int, n: int) -> list[int]:
    """n random ids, then their first three again: the drafter has a match from the first token on."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, 1000) for _ in range(n)]
    return ids + ids[:3]


def both_ways(
    model: Transformer | str, prompt: list[int], params: SamplingParams, **settings
) -> tuple[list, list, FastRunner]:
    """(plain tokens, drafted tokens, the drafting runner) of one request on two runners of `model` (a preset:
    its random weights)."""
    model = model_of(model) if isinstance(model, str) else model
    resolved = replace(RunnerSettings.resolve(model.cfg, DEVICE, DTYPE), **settings)
    plain = FastRunner(model, 128, settings=resolved, speculation=OFF)
    drafted = FastRunner(model, 128, settings=resolved, speculation=ON)
    return list(plain.generate_tokens(prompt, params)), list(drafted.generate_tokens(prompt, params)), drafted


def assert_drafts_both_kept_and_rejected(runner: FastRunner, tokens: int) -> None:
    counts = runner.counts
    # every step emits one token of its own and the drafts it accepted
    assert counts.decode_steps + counts.draft_n_accepted == tokens - 1, counts
    if (
        ON_GPU
    ):  # a tiny model's GPU step is a fraction of a verify step's: drafting pauses (graph tests below)
        return
    assert 0 < counts.draft_n_accepted < counts.draft_n, counts


@pytest.mark.parametrize(
    "preset,seed,length,settings",
    [
        # a 69-token prompt: past the 64-token windows; reductions delayed by 2 layers; two lane groups decode
        ("tiny-laneformer", 3, 66, {"lane_groups": 2}),
        ("tiny-qwen3", 1, 12, {}),  # q/k norms
        ("tiny-llama", 3, 12, {}),
    ],
)
@torch.no_grad()
def test_greedy_tokens_are_plain_decodings(preset, seed, length, settings):
    params = SamplingParams(max_new_tokens=16)
    plain, drafted, runner = both_ways(preset, copying_prompt(seed, length), params, **settings)
    assert drafted == plain
    assert_drafts_both_kept_and_rejected(runner, len(plain))


@torch.no_grad()
def test_a_prediction_of_the_reply_is_drafted_from_and_changes_no_token():
    model, params = model_of("tiny-llama"), SamplingParams(max_new_tokens=16)
    prompt = [5, 9, 300, 41]  # nothing in it to copy
    plain, drafted, runner = both_ways(model, prompt, params)
    assert drafted == plain
    with_prediction = list(runner.generate_tokens(prompt, params, prediction=tuple(plain[1:])))
    assert with_prediction == plain
    counts = runner.counts
    assert counts.decode_steps + counts.draft_n_accepted == len(plain) - 1, counts
    assert ON_GPU or counts.draft_n_accepted >= len(plain) // 2, counts


@torch.no_grad()
def test_packed_projections_go_on_from_a_verify_step():
    # one lane, o-proj, gate/up and down-proj packed: the gate/up's sums and norm scalar live across a step's
    # layers only (the o-proj clears them), so a verify step leaves nothing for them to undo
    model = bf16_valued(make_model("tiny-qwen3", seed=9, intermediate_size=192))
    plain, drafted, runner = both_ways(
        model, copying_prompt(1, 12), SamplingParams(max_new_tokens=12), **ALL_PACKED
    )
    assert drafted == plain
    assert ON_GPU or runner.counts.draft_n_accepted > 0, runner.counts


@torch.no_grad()
def test_seeded_sampling_with_a_repetition_penalty_draws_the_plain_tokens():
    # the sampler's draw at a position is keyed by the seed and the position; the penalty reads the seen ids,
    # which a rejected draft's later rows must leave as plain decoding has them
    params = SamplingParams(max_new_tokens=16, temperature=0.3, top_k=40, repetition_penalty=1.05, seed=5)
    plain, drafted, runner = both_ways("tiny-qwen3", copying_prompt(3, 12), params)
    assert drafted == plain
    assert ON_GPU or runner.counts.draft_n_accepted > 0, runner.counts


def laneformer_decoding(tokens: int) -> tuple[Transformer, FastRunner, list[int], list[int]]:
    """(tiny-laneformer, a runner of it without drafts, a 69-token prompt past its windows, its plain greedy tokens)."""
    model = model_of("tiny-laneformer")
    runner = FastRunner(model, 128, speculation=OFF)
    prompt = copying_prompt(3, 66)
    return model, runner, prompt, list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=tokens)))


@torch.no_grad()
@pytest.mark.parametrize("products", ["as chosen", "skinny_linear"])
def test_verify_rows_are_the_plain_steps_logits_and_decoding_goes_on_after_it(products, monkeypatch):
    if products == "skinny_linear":  # every product of the step by the kernel (the CPU's choice is torch's)
        few = lambda x, w, pdl: skinny_linear(x, w, use_pdl=pdl) if x.shape[1] <= MAX_ROWS else x @ w.mT  # noqa: E731
        monkeypatch.setattr(prefill, "few_rows_matmul", few)
    model, runner, prompt, plain = laneformer_decoding(6)
    n = len(prompt)
    runner.prefill(prompt)  # token plain[0] at position n
    # the first two drafts are the plain tokens, the third is not: rows 0..2 must choose plain[1..3]
    wrong = (plain[3] + 1) % 1000
    logits = runner.verify(n, [plain[1], plain[2], wrong])
    assert logits.shape == (4, model.cfg.vocab_size) and logits.dtype == torch.float32
    assert logits.argmax(-1)[:3].tolist() == plain[1:4]
    # rows 0..2 see the inputs plain[0..2] only (causal): the reference's rows at positions n .. n + 2
    reference = model(torch.tensor([prompt + plain[:3]], device=DEVICE), 0)[0, n:].float()  # [3, V]
    rel = (logits[:3] - reference).norm() / reference.norm()
    assert rel < (2e-2 if ON_GPU else 1e-4)  # bf16 on a GPU: cuBLAS and the kernels round differently
    # accept plain[1], plain[2], then the model's plain[3]: the next plain steps continue the plain tokens, over
    # the rejected draft's cache row
    runner._take_verified(n, plain[1:4], plain[1:4] + [0], set(prompt) | set(plain[:4]))
    assert int(runner.pos) == n + 3
    runner.decode_step()
    runner.decode_step()
    assert runner.out_tokens[n : n + 6].tolist() == plain


@torch.no_grad()
def test_a_greedy_verify_step_decides_on_the_device_and_plain_decoding_goes_on_after_it():
    _, runner, prompt, plain = laneformer_decoding(7)
    n, wrong = len(prompt), (plain[3] + 1) % 1000
    # two drafts kept then one rejected (the model's own token ends the step); then all three kept
    for draft, emitted in (([plain[1], plain[2], wrong], plain[1:4]), (plain[1:4], plain[1:5])):
        runner.prefill(prompt)  # token plain[0] at position n
        assert runner.verify_greedy(n, draft) == emitted
        assert (int(runner.pos), int(runner.token)) == (n + len(emitted), emitted[-1])
        assert bool(runner.seen[torch.tensor(emitted, device=DEVICE)].all())
        for _ in range(len(plain) - 1 - len(emitted)):
            runner.decode_step()
        assert runner.out_tokens[n : n + len(plain)].tolist() == plain


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
@torch.no_grad()
def test_a_verify_step_replays_a_graph_with_the_eager_steps_logits():
    model = model_of("tiny-laneformer")
    runner = FastRunner(model, 128, speculation=ON)
    # captured at build: up to 4 drafts, 5 rows; the logits' graphs and the greedy ones that accept on the device
    assert set(runner.verify_graphs.graphs) == set(runner.verify_graphs.greedy_graphs) == {2, 4, 8}
    prompt = copying_prompt(3, 66)
    n = len(prompt)
    runner.prefill(prompt)
    for draft in ([5, 6, 7], [5, 6]):  # 4 rows: the bucket's own shape; 3 rows: a bucket of 4
        replayed = runner.verify(n, draft).clone()
        eager = runner.verify_graphs.forward(
            len(draft) + 1
        ).float()  # the staged step again, launched eagerly
        assert replayed.shape == eager.shape == (len(draft) + 1, model.cfg.vocab_size)
        if len(draft) == 3:
            assert torch.equal(replayed, eager)
        else:  # cuBLAS may round a 4-row product's rows and a 3-row one's an ulp apart
            assert (replayed - eager).norm() / eager.norm() < 1e-2
            assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    for draft in ([5, 6, 7], [5, 6]):  # the greedy graphs leave what the eager greedy step leaves
        runner.prefill(prompt)
        replayed = runner.verify_greedy(n, draft), int(runner.pos), int(runner.token)
        runner.prefill(prompt)
        runner.verify_graphs.stage(n, draft)
        runner.verify_graphs.accept(len(draft) + 1)
        assert (runner.verify_graphs.read_accepted(), int(runner.pos), int(runner.token)) == replayed


@pytest.mark.skipif(not ON_GPU, reason="the GPU's default")
def test_on_a_gpu_a_small_model_decodes_plainly_unless_speculation_is_asked_for(monkeypatch):
    model = model_of("tiny-qwen3")
    monkeypatch.delenv("KOG_SPECULATIVE", raising=False)
    assert not FastRunner(model, 64).speculation.enabled
    monkeypatch.setenv("KOG_SPECULATIVE", "1")
    assert FastRunner(model, 64).speculation.enabled


def test_the_engine_reports_the_fast_runners_drafts(monkeypatch):
    monkeypatch.setenv("KOG_BACKEND", "fast")
    monkeypatch.setenv("KOG_DRAFT_MAX", "4")
    monkeypatch.setenv("KOG_SPECULATIVE", "1")  # asked for: on a GPU a model this small would decode plainly
    engine = Engine.load("tiny-qwen3", device=str(DEVICE))
    assert isinstance(engine.runner, FastRunner) and engine.runner.speculation == ON
    done = list(engine.generate(copying_prompt(3, 12), SamplingParams(max_new_tokens=12)))[-1]
    assert isinstance(done, Done)
    stats = done.stats
    assert stats.decode_steps + stats.draft_n_accepted == stats.completion_tokens - 1
    assert (
        ON_GPU or stats.draft_n > 0
    )  # on a GPU a tiny model's drafting pauses (its steps are too short to pay)
    monkeypatch.setenv("KOG_SPECULATIVE", "0")
    off = Engine.load("tiny-qwen3", device=str(DEVICE))
    stats = list(off.generate(copying_prompt(3, 12), SamplingParams(max_new_tokens=12)))[-1].stats
    assert (stats.draft_n, stats.decode_steps) == (0, stats.completion_tokens - 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_the_verify_curve_refuses_in_one_line_without_a_gpu(tmp_path):
    command = [sys.executable, "-m", "inference.bench.speculative", "--verify-curve", "--json", "spec.json"]
    done = subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("needs a CUDA GPU") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "spec.json").exists()
