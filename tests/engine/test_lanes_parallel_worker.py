"""The worker serving a Laneformer with its lanes divided among processes (KOG_GPUS / --gpus; gloo on the CPU
here), or a Qwen as tensor parallelism: the real worker, web process and openai client give the one-process
engine's greedy text, and lanes or heads the processes cannot share are refused at start in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from common.events import SamplingParams
from tests.support import ROOT

MODEL = "lanes=tiny-laneformer"  # 4 lanes
PROMPT = "def add(a, b):\n    return"


@pytest.mark.slow
def test_a_worker_on_two_ranks_answers_with_the_one_process_engines_tokens(start_worker, start_web):
    from inference.engine import Engine

    worker = start_worker(models=[MODEL], env={"KOG_GPUS": "2", "KOG_BACKEND": "reference"})
    web = start_web(env={"MODELS": MODEL})
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="no-key-needed", max_retries=0, timeout=120)
    answers = [
        client.completions.create(model="lanes", prompt=PROMPT, max_tokens=16, temperature=0)
        for _ in range(2)
    ]
    sampled = client.completions.create(model="lanes", prompt=PROMPT, max_tokens=16, temperature=0.9, seed=7)

    engine = Engine.load("tiny-laneformer", device="cpu")
    params = SamplingParams(max_new_tokens=16, temperature=0)
    done = list(engine.generate(engine.encode_prompt(PROMPT), params))[-1]
    for answer in answers:  # the second job runs on the ranks the first one left
        assert answer.choices[0].text == done.text
        assert answer.usage.completion_tokens == done.stats.completion_tokens
    # rank 0 samples from the gathered logits with the request's seed, as the one-process engine does
    params = SamplingParams(max_new_tokens=16, temperature=0.9, seed=7)
    assert sampled.choices[0].text == list(engine.generate(engine.encode_prompt(PROMPT), params))[-1].text
    assert sampled.choices[0].text != done.text  # the sampling took effect
    assert "and 1 more ranks" in worker.log_path.read_text()
    # a prompt's own logprobs need a whole model, which no rank holds: refused, and the worker serves on
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="lanes", prompt=PROMPT, max_tokens=4, logprobs=1, echo=True)
    assert (
        refused.value.body["param"] == "prompt_logprobs" and "several GPUs" in refused.value.body["message"]
    )
    echoed = client.completions.create(model="lanes", prompt=PROMPT, max_tokens=16, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + done.text

    followers = children(worker.process.pid)
    assert followers, "the worker started no follower rank"
    for pid in followers:  # NVLink multicast off in every process, from its start
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"NCCL_NVLS_ENABLE=0" in environment and b"TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in environment
    worker.kill()  # no goodbye: the followers notice on their own
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in followers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in followers if Path(f"/proc/{pid}").exists()], "a follower outlived its worker"


@pytest.mark.slow
def test_the_fast_backends_ranks_decode_the_one_process_fast_engines_tokens(
    start_worker, start_web, monkeypatch
):
    from inference.engine import Engine

    # the fast path's kernels on every rank (Triton's interpreter here), exchanging through shared-memory mailboxes
    worker = start_worker(models=[MODEL], env={"KOG_GPUS": "2", "KOG_BACKEND": "fast"})
    web = start_web(env={"MODELS": MODEL})
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="no-key-needed", max_retries=0, timeout=300)
    greedy = client.completions.create(model="lanes", prompt=PROMPT, max_tokens=12, temperature=0)
    sampled = client.completions.create(model="lanes", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7)
    # ends at its stop string, mid-order: the ranks still finish the order's steps together
    cut = greedy.choices[0].text[4:8]
    stopped = client.completions.create(
        model="lanes", prompt=PROMPT, max_tokens=12, temperature=0, stop=[cut]
    )
    again = client.completions.create(model="lanes", prompt=PROMPT, max_tokens=12, temperature=0)
    # served by the ranks' eager steps (rank 0 holds only its lanes: no whole model to fall back on)
    with_logprobs = client.completions.create(
        model="lanes", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )

    monkeypatch.setenv("KOG_BACKEND", "fast")
    monkeypatch.setenv("KOG_SPECULATIVE", "0")  # the lanes do not speculate: plain steps against plain steps
    engine = Engine.load("tiny-laneformer", device="cpu")

    def text(**sampling) -> str:
        params = SamplingParams(max_new_tokens=12, **sampling)
        return list(engine.generate(engine.encode_prompt(PROMPT), params))[-1].text

    assert greedy.choices[0].text == again.choices[0].text == text(temperature=0)
    assert sampled.choices[0].text == text(temperature=0.9, seed=7) != greedy.choices[0].text
    assert stopped.choices[0].text == greedy.choices[0].text[: greedy.choices[0].text.index(cut)]
    assert "fast decode); rank 0 holds 2 of the 4 lanes" in worker.log_path.read_text()
    params = SamplingParams(max_new_tokens=6, temperature=0, logprobs=2)
    local = [e for e in engine.generate(engine.encode_prompt(PROMPT), params) if e.kind == "delta"]
    expected = [entry for e in local for entry in e.logprobs]
    got = with_logprobs.choices[0].logprobs
    assert got.tokens == [entry["token"] for entry in expected] and len(expected) == 6
    for i, entry in enumerate(expected):
        assert got.token_logprobs[i] == pytest.approx(entry["logprob"], abs=1e-4)
        assert got.top_logprobs[i] == pytest.approx(
            {top["token"]: top["logprob"] for top in entry["top"]}, abs=1e-4
        )


@pytest.mark.slow
def test_a_qwen_on_two_ranks_is_served_as_tensor_parallelism_with_the_one_process_engines_tokens(
    start_worker, start_web, monkeypatch
):
    from inference.engine import Engine

    model = "tp=tiny-qwen3"  # 2 KV heads: one a rank
    worker = start_worker(models=[model], env={"KOG_GPUS": "2", "KOG_BACKEND": "fast"})
    web = start_web(env={"MODELS": model})
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="no-key-needed", max_retries=0, timeout=300)
    greedy = client.completions.create(model="tp", prompt=PROMPT, max_tokens=12, temperature=0)
    sampled = client.completions.create(model="tp", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7)

    monkeypatch.setenv("KOG_BACKEND", "fast")
    monkeypatch.setenv("KOG_SPECULATIVE", "0")
    engine = Engine.load("tiny-qwen3", device="cpu")

    def text(**sampling) -> str:
        params = SamplingParams(max_new_tokens=12, **sampling)
        return list(engine.generate(engine.encode_prompt(PROMPT), params))[-1].text

    assert greedy.choices[0].text == text(temperature=0)
    assert sampled.choices[0].text == text(temperature=0.9, seed=7) != greedy.choices[0].text
    assert "rank 0 holds 1 of the 2 tensor-parallel shares" in worker.log_path.read_text()


@pytest.mark.slow
def test_a_lost_rank_fails_the_request_and_the_worker_says_why(start_worker, start_web):
    worker = start_worker(models=[MODEL], env={"KOG_GPUS": "2", "KOG_BACKEND": "reference"})
    web = start_web(env={"MODELS": MODEL})
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="no-key-needed", max_retries=0, timeout=120)
    followers = children(worker.process.pid)
    for pid in followers:
        os.kill(pid, signal.SIGKILL)
    # the request after the followers are dead (a zombie until the worker reaps it), not while a kill is on its way
    deadline = time.monotonic() + 30
    while not all(dead(pid) for pid in followers) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(openai.APIError):
        client.completions.create(model="lanes", prompt=PROMPT, max_tokens=4, temperature=0)
    assert worker.process.poll() is None  # the worker stays up, and its log names the cause
    assert "has ended: restart this worker" in worker.log_path.read_text()


def dead(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie its parent has not reaped yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:  # gone meanwhile
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.append(int(status.parent.name))
    return found


@pytest.mark.parametrize(
    ("model", "flags", "words"),
    [
        (MODEL, ["--gpus", "3"], "KOG_GPUS=3: 3 processes cannot share 4 lanes evenly"),
        (
            "tp=tiny-qwen2",
            ["--gpus", "2"],
            "KOG_GPUS=2: 2 processes cannot share the 1 key/value heads of this qwen2",
        ),
        (
            MODEL,
            ["--gpus", "2", "--device", "cuda:1"],
            "choose them with CUDA_VISIBLE_DEVICES, not the device cuda:1",
        ),
    ],
)
def test_what_the_lane_processes_cannot_serve_is_refused_at_start(redis_url, model, flags, words):
    done = subprocess.run(
        [sys.executable, "-m", "inference.worker", "--redis-url", redis_url, "--model", model, *flags],
        cwd=ROOT, env={**os.environ, "KOG_DEVICE": "cpu"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 78, done.stderr
    assert words in done.stderr


@pytest.mark.parametrize(("flag", "variable"), [(["--gpus", "0"], {}), ([], {"KOG_GPUS": "two"})])
def test_a_gpu_count_that_is_no_positive_integer_is_refused(redis_url, flag, variable):
    done = subprocess.run(
        [sys.executable, "-m", "inference.worker", "--redis-url", redis_url, "--model", MODEL, *flag],
        cwd=ROOT, env={**os.environ, "KOG_DEVICE": "cpu", **variable}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "KOG_GPUS" in done.stderr or "--gpus" in done.stderr
