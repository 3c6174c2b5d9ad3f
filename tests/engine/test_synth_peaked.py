"""synth.make_peaked: random weights whose logits have a trained model's margins, so that bench --check's
argmax rule can be met in bf16 and still depends on what the layers compute."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference.bench import cli, correctness, model_setup, timing
from inference.checkpoint import load_weights
from inference.config import ModelConfig
from inference.fast.runner import FastRunner
from inference.model import KVCache, Transformer
from inference.presets import preset_config
from inference.synth import make_peaked, peaked_model, synth
from tests.support.kernels import DEVICE

ROOT = Path(__file__).resolve().parents[2]
# tiny-laneformer (untied head: the two-successor fork) made wide enough for the candidates' margin over the
# other 1,022 logits to be reachable (at D = 64 a unit embedding cannot stand far enough above them)
WIDE_LANEFORMER = {"hidden_size": 256}


def build(preset: str, dtype: torch.dtype, device="cpu", seed: int = 0, peaked: bool = True, **overrides):
    cfg = ModelConfig.from_hf({**preset_config(preset), **overrides})
    model = Transformer(cfg, device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(generator=generator)
    if peaked:
        make_peaked(model, generator)
    return model.eval()


class ReferenceRunner:
    """The reference model behind the runner interface bench.correctness.check drives: the check then measures
    the reference itself (in its dtype) against its fp32 copy."""

    def __init__(self, model: Transformer, max_len: int):
        self.model = model
        self.cache = KVCache(model.cfg, max_len, 1, model.tok_embeddings.device, model.tok_embeddings.dtype)
        self.token = torch.zeros(1, dtype=torch.long, device=model.tok_embeddings.device)
        self.pos = 0

    def prefill(self, ids: list[int]) -> None:
        ids_t = torch.tensor([ids], device=self.token.device)
        self.logits = self.model(ids_t, 0, self.cache, last_only=True).view(-1)
        self.pos = len(ids)

    def step(self) -> None:
        self.logits = self.model(self.token.view(1, 1), self.pos, self.cache).view(-1)
        self.pos += 1


def reference_check(model: Transformer, steps: int) -> dict:
    prompt = correctness.check_prompt("tiny-laneformer", model.cfg.vocab_size)
    return correctness.check(model, ReferenceRunner(model, len(prompt) + steps + 1), steps, prompt, "peaked")


def test_bf16_matches_fp32_while_the_layers_decide_a_share_of_steps():
    peaked = reference_check(build("tiny-laneformer", torch.bfloat16, **WIDE_LANEFORMER), 512)
    assert peaked["fp32_argmax_agree"] >= 0.99  # the bf16 reference against its fp32 copy
    assert peaked["decisive_steps"] >= 0.97 * 512
    # the skip path alone (head on the current embedding) is overruled by the layers at a real share of steps
    assert 0.05 <= 1 - peaked["skip_path_argmax_agree"] <= 0.5
    assert peaked["top_logit_norm_share_median"] < 0.1  # no single logit hides the others' error
    # the same shapes with init_weights' random weights: near-ties bf16 cannot order
    flat = reference_check(build("tiny-laneformer", torch.bfloat16, peaked=False, **WIDE_LANEFORMER), 512)
    assert peaked["fp32_margin_p10"] > 20 * flat["fp32_margin_p10"]
    assert peaked["fp32_margin_median"] > 10 * flat["fp32_margin_median"]


def test_tied_head_scores_both_cycle_neighbours_and_not_itself():
    model = build("tiny-qwen3", torch.float32, hidden_size=256)
    assert set(model.norm.flatten().tolist()) == {1.0, -1.0}  # the sign split that makes self-scores vanish
    tokens = torch.arange(64)
    skip = torch.stack([correctness.skip_path_logits(model, t) for t in tokens])  # [64, V]
    top3 = skip.topk(3, dim=-1)
    # two neighbours far above everything else, the token itself (about zero, +- the others' spread) below them
    assert ((top3.values[:, 1] - top3.values[:, 2]) > 0.4 * top3.values[:, 1]).all()
    assert (top3.indices[:, :2] != tokens[:, None]).all()
    assert (skip[tokens, tokens] < 0.6 * top3.values[:, 1]).all()
    # symmetric, as a tied head must be: each neighbour has the token among its own two
    for t, neighbours in zip(tokens.tolist(), top3.indices[:, :2].tolist(), strict=True):
        for n in neighbours:
            assert t in correctness.skip_path_logits(model, torch.tensor(n)).topk(2).indices.tolist()


def test_fast_runner_agrees_with_fp32_on_a_peaked_model():
    # fp16: real rounding between kernels (the interpreter computes bf16 wrongly)
    model = build("tiny-llama", torch.float16, device=DEVICE)
    prompt = correctness.check_prompt("tiny-llama", model.cfg.vocab_size, length=16)
    result = correctness.check(model, FastRunner(model, 96), 64, prompt, "peaked")
    assert result["fp32_argmax_agree"] >= 0.99
    assert result["argmax_agree"] >= 0.99
    assert result["fp32_max_rel_err"] < 2e-3
    assert result["decisive_fp32_argmax_agree"] == 1.0


def test_init_peaked_refuses_a_checkpoint_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--model", str(tmp_path), "--init", "peaked"])
    assert exc.value.code == 2
    assert "checkpoint directory; --init applies to presets only" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--init applies to presets only"):
        model_setup.build_model(str(tmp_path), torch.device("cpu"), torch.float32, init="peaked")


def test_bench_builds_the_peaked_preset_from_its_random_init():
    random = model_setup.build_model("tiny-qwen2", torch.device("cpu"), torch.float32, seed=4)
    peaked = model_setup.build_model("tiny-qwen2", torch.device("cpu"), torch.float32, seed=4, init="peaked")
    gain = (peaked.layers[0].wo.norm() / random.layers[0].wo.norm()).item()
    assert abs(gain - 1) > 0.1
    for ours, theirs in zip(peaked.layers, random.layers, strict=True):  # init_weights' layers, ...
        assert torch.equal(ours.wq, theirs.wq) and torch.equal(ours.w1, theirs.w1)
        torch.testing.assert_close(ours.wo, theirs.wo * gain)  # ... one gain on the block outputs
        torch.testing.assert_close(ours.w2, theirs.w2 * gain)
    assert not torch.equal(random.tok_embeddings, peaked.tok_embeddings)


def loads_as(path: Path, model: Transformer) -> None:
    weights = load_weights(path, model.cfg)
    state = model.state_dict()
    assert weights.keys() == state.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name
    ids = torch.tensor([[5, 17, 300, 2, 999]])
    # copies at torch's own alignment: a CPU GEMM may sum in another order for a buffer the file placed otherwise
    loaded = Transformer.from_weights(model.cfg, {name: tensor.clone() for name, tensor in weights.items()})
    assert torch.equal(loaded(ids), model(ids))


def test_synth_cli_writes_the_peaked_model(tmp_path):
    out = tmp_path / "q2"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "inference.synth",
            "--preset",
            "tiny-qwen2",
            "--out",
            out,
            "--seed",
            "3",
            "--peaked",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "peaked" in done.stdout
    cfg = ModelConfig.from_hf(out)
    loads_as(out, peaked_model(cfg, seed=3))


def test_synth_peaked_lanes_and_shared_norms_round_trip(tmp_path):
    path = synth("tiny-laneformer", tmp_path / "lf", seed=1, peaked=True)
    loads_as(path, peaked_model(ModelConfig.from_hf(path), seed=1))


def test_the_sampled_benchmark_row_uses_the_page_defaults():
    # the benchmark's sampled row times what a visitor gets without touching the settings
    from playground.views import FORM_DEFAULTS

    page = (ROOT / "templates/playground/index.html").read_text()
    for name, element in (("temperature", "temperature"), ("top_p", "top-p")):
        tag = page.split(f'id="{element}"', 1)[1].split(">", 1)[0]
        assert f'value="{{{{ form.{name} }}}}"' in tag  # the form shows the view's defaults
        assert FORM_DEFAULTS[name] == timing.PAGE_SAMPLING[name]
