import ast
import json
import math

import pytest
import torch
from safetensors import safe_open

from common.events import Done, Prefilled, SamplingParams, TextDelta
from common.names import DEFAULT_MODEL_DIR
from inference.engine import Engine
from inference.eval_default import check_completion, cut_at_column_zero
from inference.tokenizer_build import CHAT_TEMPLATES, continues_code
from inference.train import TrainConfig, bits_per_byte, split_of, stdlib_files, stdlib_root, train

PROMPT = 'def clamp(value, low, high):\n    """Return value limited to the range [low, high]."""\n'


@pytest.fixture(scope="module")
def engine():
    return Engine.load(DEFAULT_MODEL_DIR, device="cpu")


def test_shipped_checkpoint_is_a_small_laneformer():
    files = list(DEFAULT_MODEL_DIR.iterdir())
    weights = sorted(DEFAULT_MODEL_DIR.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in weights) <= 60 * 10**6  # a real-time CPU model
    assert sum(f.stat().st_size for f in files) <= 64 * 1024**2
    names = {f.name for f in files}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "model.safetensors" in names or "model.safetensors.index.json" in names
    assert "generation_config.json" in names and "loss.png" in names and "README.md" in names
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "laneformer_tp"
    assert config["num_lanes"] == 2 and config["broadcast_delay"] == 1
    assert (
        config["sliding_window_n_layers"] >= 1
        and config["sliding_window"] < config["max_position_embeddings"]
    )
    for shard in weights:
        with safe_open(shard, "pt") as f:
            assert {f.get_slice(n).get_dtype() for n in f.keys()} <= {"BF16", "F16"}  # noqa: SIM118
    assert "chat_template" in json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())


def test_generates_on_cpu_through_the_normal_loader(engine):
    assert engine.config.num_lanes == 2 and engine.config.window_layers
    events = list(engine.generate(engine.encode_prompt(PROMPT), SamplingParams(max_new_tokens=48)))
    assert isinstance(events[0], Prefilled) and isinstance(events[-1], Done)
    deltas = [e for e in events[1:-1] if isinstance(e, TextDelta)]
    done = events[-1]
    assert done.text == "".join(d.text for d in deltas) and done.text.strip()
    assert all(0 <= t < engine.tokenizer.vocab_size for d in deltas for t in d.token_ids)
    # Greedy is deterministic: the same prompt gives the same text.
    *_, again = engine.generate(engine.encode_prompt(PROMPT), SamplingParams(max_new_tokens=48))
    assert again.text == done.text


def test_chat_prompt_becomes_a_comment(engine):
    ids = engine.encode_prompt("Clamp a value to a range.", chat=True)
    assert engine.tokenizer.decode(ids) == "# Clamp a value to a range.\n"
    *_, done = engine.generate(ids, SamplingParams(max_new_tokens=16))
    assert done.stats.completion_tokens >= 1


def test_chat_prompt_that_is_code_goes_in_verbatim(engine):
    # The page sends chat messages; a `def` line with its docstring must reach the model as code to continue.
    messages = [
        {"role": "system", "content": "Answer in Python."},
        {"role": "user", "content": 'def clamp(x, lo, hi):\n    """Clamp x to [lo, hi]."""'},
    ]
    ids = engine.encode_prompt(messages=messages, chat=True)
    text = engine.tokenizer.decode(ids)
    assert text == '# Answer in Python.\ndef clamp(x, lo, hi):\n    """Clamp x to [lo, hi]."""\n'


def test_trained_weights_model_held_out_python(engine):
    # A trained model predicts held-out Python far better than chance (log2(V) bits per token,
    # about 3.4 bits per byte here); the shipped one measures about 1 bit per byte.
    root = stdlib_root()
    held_out = [f for f in stdlib_files(root) if split_of(f) == "test"][:3]
    text = "".join((root / f).read_text(encoding="utf-8", errors="replace")[:3000] for f in held_out)
    ids = torch.tensor(engine.tokenizer.encode(text, add_special=False))
    bpb = bits_per_byte(engine.model, ids, len(text.encode()), 512, 4)
    assert bpb < 1.6
    chance = math.log2(engine.tokenizer.vocab_size) * len(ids) / len(text.encode())
    assert bpb < chance / 2


def test_completion_cut_and_check():
    prompt = 'def f(x):\n    """Double."""\n'
    assert cut_at_column_zero("    return 2 * x\n\ndef g():\n    pass\n") == "    return 2 * x\n"
    assert check_completion(prompt, "    return 2 * x\n\nprint(f(2)\n") == (True, True)
    assert check_completion(prompt, "\n\ndef g(:\n") == (True, False)  # parses only because it adds nothing
    assert check_completion(prompt, "    return (2 * x\n") == (False, False)
    ast.parse(prompt)


def tiny_run(tmp_path, name, seed=0):
    config = TrainConfig(
        out=tmp_path / name, device="cpu", seed=seed, steps=3, batch_size=4, seq_len=64, vocab_size=512,
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64, sliding_window=16,
        window_layers=1, eval_every=2, eval_windows=2, max_files=6, warmup_steps=2,
    )  # fmt: skip
    return train(config)


def test_training_is_reproducible(tmp_path):
    first, second = tiny_run(tmp_path, "a"), tiny_run(tmp_path, "b")
    assert first["history"]["loss"] == second["history"]["loss"]
    assert first["history"]["val_loss"] == second["history"]["val_loss"]
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    assert tiny_run(tmp_path, "c", seed=1)["history"]["loss"] != first["history"]["loss"]

    # What training writes is a checkpoint the engine loads: windowed layers, two lanes, a tokenizer.
    trained = Engine.load(tmp_path / "a", device="cpu")
    assert trained.config.window_layers == (0,) and trained.config.num_lanes == 2
    *_, done = trained.generate(trained.encode_prompt("def f(x):\n"), SamplingParams(max_new_tokens=4))
    assert done.stats.completion_tokens >= 1
    assert (tmp_path / "a/loss.png").stat().st_size > 0


def test_the_default_model_is_a_base_model_the_page_invites_code_for(engine):
    assert continues_code(engine.tokenizer.chat_template)  # its comment template: it continues code
    assert not continues_code(CHAT_TEMPLATES["chatml"]) and continues_code(None)
