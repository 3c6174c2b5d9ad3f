"""`python -m inference.generate`, and the worker's flags, as a user runs them: a real subprocess, its
stdout, stderr and exit status."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.synth import synth

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth("tiny-laneformer", tmp_path_factory.mktemp("cli") / "tiny", seed=0)


def generate(*args, tmp_path=None, env=None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "KOG_CACHE_DIR": str(tmp_path or ROOT / "var"),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "inference.generate", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_streams_text_and_json_agrees(tiny):
    streamed = generate(
        "--model", tiny, "--prompt", "def add(a, b):", "--max-new-tokens", 16, "--device", "cpu"
    )
    assert streamed.returncode == 0, streamed.stderr
    as_json = generate("--model", tiny, "--prompt", "def add(a, b):", "--max-new-tokens", 16, "--json")
    assert as_json.returncode == 0, as_json.stderr
    result = json.loads(as_json.stdout)
    assert streamed.stdout == result["text"] + "\n"
    assert len(result["token_ids"]) == result["completion_tokens"] == 16
    assert result["prompt_tokens"] > 3 and result["ttft_ms"] > 0 and result["decode_tok_s"] > 0
    assert result["finish_reason"] == "length"


def test_chat_sampling_and_bfloat16(tiny):
    args = [
        "--model",
        tiny,
        "--prompt",
        "hi",
        "--chat",
        "--max-new-tokens",
        8,
        "--json",
        "--dtype",
        "bfloat16",
    ]
    first = generate(*args, "--temperature", 0.8, "--top-p", 0.9, "--top-k", 50, "--seed", 3)
    again = generate(*args, "--temperature", 0.8, "--top-p", 0.9, "--top-k", 50, "--seed", 3)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(again.stdout)["token_ids"]
    assert json.loads(first.stdout)["prompt_tokens"] > 5  # the chat template wrapped the prompt


def broken(tiny: Path, tmp_path: Path, damage: str) -> Path:
    path = Path(shutil.copytree(tiny, tmp_path / damage))
    weights = path / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:50_000])
    elif damage == "corrupt":
        weights.write_bytes(b"\xff" * 4000)
    elif damage == "wrong-shapes":
        tensors = load_file(weights)
        tensors["model.layers.0.attention.wq.weight"] = torch.zeros(4, 8, 64)
        save_file(tensors, weights)
    elif damage == "no-tokenizer":
        (path / "tokenizer.json").unlink()
    elif damage == "unknown-model-type":
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    elif damage == "pickle-only":
        weights.unlink()
        torch.save({}, path / "pytorch_model.bin")
    elif damage == "short-context":
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    elif damage == "no-model-type":
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
    elif damage == "gptq-config":  # AutoGPTQ's own file, config.json none the wiser
        (path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    elif damage == "snapshot-without-blobs":  # an HF cache snapshot mounted without the cache's blobs/
        weights.unlink()
        weights.symlink_to("../../blobs/0b1e5a7e")
    elif damage == "gptq-tensors":
        tensors = load_file(weights)
        tensors["model.layers.0.attention.wq.qweight"] = torch.zeros(8, 64, dtype=torch.int32)
        save_file(tensors, weights)
    return path


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("truncated", "corrupt or truncated safetensors"),
        ("corrupt", "corrupt or truncated safetensors"),
        ("wrong-shapes", "wrong shape 1: model.layers.0.attention.wq.weight [4, 8, 64]"),
        ("no-tokenizer", "tokenizer.json"),
        ("unknown-model-type", "'model_type': unsupported 'mamba'"),
        ("pickle-only", "pickle"),
        ("short-context", "do not fit the 16-token context"),
        ("no-model-type", "'model_type': is required: one of"),
        ("gptq-config", "quantize_config.json: the folder holds a quantized (GPTQ) checkpoint"),
        ("gptq-tensors", "holds quantized weights (model.layers.0.attention.wq.qweight)"),
        ("snapshot-without-blobs", "model.safetensors is a broken symbolic link (to ../../blobs/0b1e5a7e)"),
    ],
)
def test_bad_checkpoints_fail_in_one_line(tiny, tmp_path, damage, words):
    model = broken(tiny, tmp_path, damage)
    result = generate("--model", model, "--prompt", "a line of text that is long enough " * 3)
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--prompt", ""], "prompt: must not be empty"),
        (["--prompt", "x", "--temperature", "-0.5"], "temperature: must be >= 0"),
        (["--prompt", "x", "--top-p", "0"], "top_p: must be in (0, 1]"),
        (["--prompt", "x", "--top-p", "1.5"], "top_p: must be in (0, 1]"),
        (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", "x", "--top-k", "lots"], "--top-k: invalid int value"),
        (["--prompt", "x", "--model", "no-such-model"], "neither a checkpoint directory nor a preset"),
        (["--max-new-tokens", "3"], "--prompt"),
    ],
)
def test_bad_requests_fail_in_one_line(tiny, tmp_path, flags, words):
    args = flags if "--model" in flags else ["--model", tiny, *flags]
    result = generate(*args, tmp_path=tmp_path)
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        (
            "KOG_MAX_CONTEXT",
            "0",
            "KOG_MAX_CONTEXT: must be an integer >= 2 (tokens: a prompt token and a new one",
        ),
        ("KOG_MAX_CONTEXT", "-5", "KOG_MAX_CONTEXT: must be an integer >= 2"),
        ("KOG_MAX_CONTEXT", "8k", "KOG_MAX_CONTEXT: must be an integer >= 2"),
        ("KOG_CPU_THREADS", "all", "KOG_CPU_THREADS: must be an integer >= 1 (CPU threads), got 'all'"),
    ],
)
def test_bad_settings_in_the_environment_fail_in_one_line(tiny, variable, value, words):
    result = generate("--model", tiny, "--prompt", "x", "--device", "cpu", env={variable: value})
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_a_model_given_as_name_equals_path_is_named_so(tiny):
    result = generate("--model", f"my-ft={tiny}", "--prompt", "def f(", "--max-new-tokens", 2, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "my-ft"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_the_benchmark_refuses_in_one_line_without_a_gpu(tmp_path):
    # its imports run first (a broken one would show here), then it says what it needs
    command = ["-m", "inference.bench", "--model", "tiny-llama", "--check", "--breakdown", "--json", "trace"]
    done = subprocess.run([sys.executable, *command], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("needs a CUDA GPU"), done.stderr
    assert not (tmp_path / "trace").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_gpu_check_refuses_in_one_line_without_a_gpu(tmp_path):
    # the one command that runs every GPU check: on a CPU it says so and stops, before writing any results
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], env={**os.environ, "OUT": str(tmp_path / "out")},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpu_check: needs a CUDA GPU") and done.stderr.count("\n") == 1, done.stderr
    assert not any((tmp_path / "out").iterdir())


def test_worker_takes_every_device_its_help_lists():
    def worker(*args):
        return subprocess.run([sys.executable, "-m", "inference.worker", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    listed = re.search(r"--device \{([^}]*)\}", worker("--help").stdout).group(1).split(",")
    assert "cpu" in listed and "cuda" in listed and "cuda:N" in listed
    for device in listed:  # --help after --device: exit 0 once the value is taken, before any model loads
        done = worker("--device", device.replace(":N", ":1"), "--help")
        assert done.returncode == 0, done.stderr


def test_the_bench_table_says_where_the_residual_was_kept():
    """inference/bench/table.py: the residual's timed addresses (inference/fast/residual_placement.py) printed with
    the ceiling, and no line for a runner that timed none."""
    from inference.bench.table import table

    result = {"model": "qwen3-1.7b", "device": "NVIDIA H200", "prompt_len": 512, "new_tokens": 256,
              "bandwidth": {"read_gbs": 4300.0, "copy_gbs": 4250.0}, "bytes_per_token": 3.5e9,
              "ceiling_tok_s": 1228.6, "rows": [{"path": "fast", "tok_s": 1110.0, "ttft_ms": 4.1}]}  # fmt: skip
    assert "residual" not in table(result)
    result["residual_placement"] = {"kept": 2, "step_us": [903.25, 899.5, 896.0]}
    assert "the residual kept at candidate 2 of 3 (inference/fast/residual_placement.py; greedy step us: " \
           "903.2, 899.5, 896.0)" in table(result).splitlines()  # fmt: skip
