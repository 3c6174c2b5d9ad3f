"""The worker's DeltaCoalescer: what it publishes, joined, is the engine's text, to the last character. And
the worker's start as a hoster meets it: a setting it cannot use, a Redis it cannot reach, a model the machine
cannot hold, each one line (a real subprocess, against the suite's real Redis)."""

import json
import os
import subprocess
import sys

import pytest

from common.events import Done, SamplingParams, TextDelta
from common.redis_server import free_port
from inference import worker as worker_module
from inference.engine import DTYPES, Engine
from inference.synth import synth
from inference.worker import DeltaCoalescer
from tests.support import ROOT
from tests.support.chosen_ids import ChosenIds


def coalescer(flush_interval_s):
    published = []
    return DeltaCoalescer(lambda kind, data: published.append((kind, data)), flush_interval_s), published


def test_a_last_delta_without_tokens_is_published():
    # The engine's last delta may carry text and no token: what it held back for a stop string's start, or an
    # unfinished character, until the generation ended.
    deltas, published = coalescer(0.0)
    deltas.add(TextDelta("ab", [5], 0.1))
    deltas.add(TextDelta("c", [], 0.2))
    deltas.flush()
    assert "".join(data["text"] for _, data in published) == "abc"
    assert published[-1][1]["n"] == 1 and published[-1][1]["token_ids"] == []
    # nothing at all to say: nothing published
    deltas.flush()
    deltas.add(TextDelta("", [], 0.3))
    deltas.flush()
    assert len(published) == 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.load(synth("tiny-qwen3", tmp_path_factory.mktemp("worker") / "q", seed=0), device="cpu")


@pytest.mark.parametrize("flush_interval_s", [0.0, 10.0])
@pytest.mark.parametrize(
    ("text", "stop"), [("x ab", "abc"), ("he said 😀", "😀!"), ("hello world", "world"), ("ab", "abcd")]
)
def test_what_the_worker_publishes_is_the_engines_text(engine, monkeypatch, flush_interval_s, text, stop):
    # as Worker._run feeds it: every TextDelta, then a flush before the Done
    ids = engine.tokenizer.encode(text, add_special=False)
    monkeypatch.setattr(engine, "runner", ChosenIds(ids))
    deltas, published = coalescer(flush_interval_s)
    for event in engine.generate(
        engine.encode_prompt("q"), SamplingParams(max_new_tokens=len(ids), stop=(stop,))
    ):
        if isinstance(event, TextDelta):
            deltas.add(event)
        elif isinstance(event, Done):
            deltas.flush()
            done = event
    cut = text.find(stop)
    assert done.text == (text if cut < 0 else text[:cut])
    assert "".join(data["text"] for _, data in published) == done.text
    assert sum(len(data["token_ids"]) for _, data in published) == done.stats.completion_tokens


def run_worker(*args: str, env: dict | None = None) -> tuple[int, list[dict], str]:
    """`python -m inference.worker ARGS` to its end: (exit status, its JSON log lines, all it wrote)."""
    done = subprocess.run([sys.executable, "-m", "inference.worker", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "LOG_FORMAT": "json", **(env or {})}, timeout=120)  # fmt: skip
    output = done.stdout + done.stderr
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return done.returncode, lines, output


@pytest.mark.parametrize(
    "variable, value, expects",
    [
        ("KOG_STALL_TIMEOUT_S", "1m", "a number of seconds >= 0 (0: no stall watchdog)"),
        ("KOG_STALL_EXIT_S", "-1", "a number of seconds >= 0 (0: never exit)"),
        ("KOG_MAX_PROMPT_TOKENS", "2k", "an integer >= 0 (tokens; 0: no cap)"),
        ("KOG_FLUSH_MS", "fast", "a number of milliseconds >= 0"),
        ("KOG_MAX_CONTEXT", "8k", "an integer >= 2 (tokens: a prompt token and a new one at least)"),
        ("KOG_MAX_CONTEXT", "1", "an integer >= 2 (tokens: a prompt token and a new one at least)"),
        ("KOG_DTYPE", "fp16", "one of float32, bfloat16, float16"),
        ("KOG_DEVICE", "gpu", "one of cpu, cuda, cuda:N"),
        ("KOG_DEVICE", "cuda:x", "one of cpu, cuda, cuda:N"),
        ("KOG_BACKEND", "turbo", "one of reference, fast"),
        ("KOG_PREFIX_SLOTS", "many", "an integer >= 0 (KV-cache slots)"),
    ],
)
def test_a_setting_it_cannot_use_ends_it_in_one_line_naming_the_variable(redis_url, variable, value, expects):
    # before Redis or any model: the folder named here does not exist, and it is not what it says
    status, lines, output = run_worker(
        "--model", "/nowhere/my-ft", "--redis-url", redis_url, env={variable: value}
    )
    assert status == 2, output
    assert [(line["level"], line["msg"]) for line in lines] == [
        ("ERROR", f"{variable}: must be {expects}, got {value!r}")
    ]
    assert "Traceback" not in output


def test_a_gpu_of_several_is_a_device_it_takes(redis_url):
    # KOG_DEVICE=cuda:1 (a worker per GPU) passes the settings' check: what ends this one is the missing folder
    status, lines, output = run_worker(
        "--model", "/nowhere/my-ft", "--redis-url", redis_url, env={"KOG_DEVICE": "cuda:1"}
    )
    assert status == worker_module.LOAD_EXIT_CODE, output
    assert "KOG_DEVICE" not in output and "/nowhere/my-ft" in lines[-1]["msg"], output


def test_the_dtypes_the_worker_takes_are_the_engines():
    assert tuple(DTYPES) == worker_module.DTYPE_NAMES


@pytest.mark.parametrize(
    "url, status, words",
    [
        ("127.0.0.1:6379", 2, "REDIS_URL=127.0.0.1:6379 is not a Redis URL (Redis URL must specify one of"),
        (
            "redis://:s3cret@127.0.0.1:{port}/0",
            69,
            "cannot reach Redis at REDIS_URL=redis://:***@127.0.0.1:{port}/0: ",
        ),
        (  # redis-py's reason would quote a piece of this password: "Port could not be cast ... 's3cret'"
            "redis://:s3cret?x@127.0.0.1:{port}/0",
            2,
            "REDIS_URL=redis://:***@127.0.0.1:{port}/0 is not a Redis URL (check the host and port, and "
            "percent-encode",
        ),
    ],
)
def test_a_redis_it_cannot_use_ends_it_before_any_model_loads(url, status, words):
    port = free_port()
    # a model that would fail to load (78) if loading came first
    code, lines, output = run_worker("--model", "/nowhere/my-ft", env={"REDIS_URL": url.format(port=port)})
    assert code == status, output
    (line,) = lines
    assert line["level"] == "ERROR" and line["msg"].startswith(words.format(port=port)), line
    assert "s3cret" not in output and "Traceback" not in output


def huge_context(tmp_path, positions: int) -> str:
    path = synth("tiny-llama", tmp_path / "my-ft", seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return str(path)


def test_a_model_the_machine_cannot_hold_is_one_line_naming_it(tmp_path, redis_url):
    # RoPE tables for 2**48 positions (a petabyte): refused by any allocator at once
    model = huge_context(tmp_path, 2**48)
    status, lines, output = run_worker("--model", model, "--redis-url", redis_url, env={"KOG_DEVICE": "cpu"})
    assert status == worker_module.LOAD_EXIT_CODE, output
    (line,) = lines
    assert line["level"] == "ERROR" and line["msg"].startswith(
        f"cannot load model {model}: my-ft: out of cpu memory while building its RoPE tables"
    ), line
    assert "Traceback" not in output


@pytest.mark.gpu
def test_a_kv_cache_the_gpu_cannot_hold_is_one_line_saying_to_lower_kog_max_context(tmp_path, redis_url):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # float32: per position, RoPE tables 64 B, K 256 B, V 256 B. Sized so that the tables and K fit the GPU and
    # V does not: the KV cache is what runs out, as with a hoster's KOG_MAX_CONTEXT too large for the GPU.
    positions = torch.cuda.mem_get_info()[1] // 450
    model = huge_context(tmp_path, positions)
    env = {
        "KOG_DEVICE": "cuda",
        "KOG_DTYPE": "float32",
        "KOG_MAX_CONTEXT": str(positions),
        "KOG_BACKEND": "reference",
    }
    status, lines, output = run_worker("--model", model, "--redis-url", redis_url, env=env)
    assert status == worker_module.LOAD_EXIT_CODE, output
    (line,) = lines
    assert line["msg"].startswith(
        f"cannot load model {model}: my-ft: out of cuda memory while allocating the KV cache for {positions} "
        "tokens ("
    ), line
    assert "lower KOG_MAX_CONTEXT" in line["msg"] and "CUDA out of memory" in line["msg"], line
    assert "Traceback" not in output


def test_a_load_failure_of_the_machine_is_one_line_and_a_bugs_keeps_its_traceback():
    load_failure = worker_module.load_failure
    assert load_failure(MemoryError()) == ("MemoryError", True)
    assert load_failure(RuntimeError("CUDA error: an illegal memory access was encountered\nmore")) == (
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        True,
    )
    assert load_failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 9 GB"))[1]
    # a shape mismatch, a missing feature: bugs, logged with their traceback
    for bug in (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), NotImplementedError("no")):
        assert load_failure(bug)[1] is False
