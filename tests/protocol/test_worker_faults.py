"""The worker's faults on a real Redis: a token stall, Redis restarting (idle and mid-job), out of memory.

Workers run as real subprocesses on the stand-in engine (`standin:<tokens/s>`, which echoes its
prompt at a fixed rate), so a slow rate is a stalled model and a fast one a healthy model.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from common.protocol import JobClient, JobSpec, WorkerChannel, connect, events_key, job_key, queue_key
from common.redis_server import free_port, start_redis
from inference import worker as worker_module
from inference.standin import StandinEngine
from inference.worker import Worker
from inference.worker import main as worker_main
from tests.support import WorkerProcess

pytestmark = pytest.mark.timeout(90)

SLOW, FAST = "standin:0.4", "standin:500"  # a token every 2.5 s (stalls at 1 s), and a healthy one


async def run_job(jobs: JobClient, spec: JobSpec, timeout_s: float = 30) -> list[tuple[str, dict]]:
    """(type, data) of the job's events until done or error."""
    await jobs.submit(spec)
    events = []
    async with asyncio.timeout(timeout_s):
        async for _, kind, data in jobs.events(spec.id, block_ms=100):
            if kind != "queue":
                events.append((kind, data))
    return events


@pytest.fixture
async def jobs(redis_url):
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield JobClient(r)
    await r.aclose()


async def test_a_token_stall_ends_the_job_with_an_error_and_the_worker_serves_the_next(jobs, start_worker):
    worker = start_worker([SLOW, FAST], env={"KOG_STALL_TIMEOUT_S": "1"})
    stalled = JobSpec(model=SLOW, prompt="abc", params={"max_new_tokens": 5})
    events = await run_job(jobs, stalled, timeout_s=15)
    kinds = [kind for kind, _ in events]
    assert kinds == ["started", "prefilled", "delta", "error"], events
    assert events[-1][1]["code"] == "stalled" and "no token for 1 s" in events[-1][1]["message"]
    assert (await jobs.status(stalled.id))["status"] == "error"

    healthy = JobSpec(model=FAST, prompt="xyz", params={"max_new_tokens": 6})
    events = await run_job(jobs, healthy)
    assert events[-1][0] == "done" and events[-1][1]["text"] == "xyzxyz"
    # the stalled job's loop came back (at its next token) without writing a second ending
    entries = await jobs.r.xrange(events_key(stalled.id))
    assert [fields["type"] for _, fields in entries][-1] == "error"
    assert sum(fields["type"] in ("done", "error") for _, fields in entries) == 1
    assert worker.process.poll() is None
    # the worker's log is JSON lines, and the watchdog's line names the job it ended
    lines = [json.loads(line) for line in worker.log_path.read_text().splitlines()]
    assert any(e["msg"].startswith("no token for") and e.get("job_id") == stalled.id for e in lines)
    assert {e.get("job_id") for e in lines if e["msg"] == "job started"} == {stalled.id, healthy.id}


@pytest.fixture
def own_redis(tmp_path):
    """A Redis this test may kill and restart on the same port (the suite's one is shared)."""
    port = free_port()
    state = {"process": start_redis(tmp_path / "redis", port=port)[0]}

    def restart(down_s: float) -> None:
        state["process"].kill()
        state["process"].wait()
        time.sleep(down_s)
        state["process"] = start_redis(tmp_path / "redis", port=port)[0]

    yield f"redis://127.0.0.1:{port}/0", restart
    state["process"].kill()
    state["process"].wait()


async def test_the_worker_rides_out_redis_restarts_idle_and_mid_job(own_redis, tmp_path):
    url, restart = own_redis
    worker = WorkerProcess(url, ["standin:40", FAST], tmp_path / "worker.log")
    try:
        worker.wait_ready(timeout_s=30)
        restart(down_s=3)  # idle, and longer than the client's own retries: the serve loop waits it out
        worker.wait_ready(timeout_s=15)  # its heartbeat is back in the new, empty Redis

        r = aioredis.Redis.from_url(url, decode_responses=True)
        jobs = JobClient(r)
        long_job = JobSpec(model="standin:40", prompt="long ", params={"max_new_tokens": 400})  # 10 s
        await jobs.submit(long_job)
        async with asyncio.timeout(15):
            async for _, kind, _ in jobs.events(long_job.id, block_ms=100):
                if kind == "delta":
                    break
        await r.aclose()
        restart(down_s=0.5)  # mid-job: the job's state is gone with the old Redis
        worker.wait_ready(timeout_s=15)

        r = aioredis.Redis.from_url(url, decode_responses=True)
        jobs = JobClient(r)
        # The worker drops the vanished job at its next flush instead of generating it to the end,
        # so the next job starts well before the long one would have finished.
        events = await run_job(
            jobs, JobSpec(model=FAST, prompt="ok", params={"max_new_tokens": 4}), timeout_s=8
        )
        assert events[-1] == ("done", events[-1][1]) and events[-1][1]["text"] == "okok"
        assert not await r.exists(job_key(long_job.id))
        await r.aclose()
        assert worker.process.poll() is None
    finally:
        worker.stop()
    log = worker.log_path.read_text()
    assert "redis unavailable" in log and "redis is back" in log


async def test_after_a_restart_lost_a_job_its_reader_is_told_and_its_worker_writes_nothing(own_redis):
    url, restart = own_redis
    r = connect(url, use_asyncio=True)
    jobs = JobClient(r)
    channel = WorkerChannel(connect(url), "w", ["m"])
    spec = JobSpec(model="m", prompt="x")
    await jobs.submit(spec)
    channel.heartbeat({})
    channel.next_job(timeout_s=1)
    assert channel.publish(spec.id, "delta", {"text": "a"})
    reader = jobs.events(spec.id, block_ms=100)
    assert [(await anext(reader))[1] for _ in range(2)] == ["started", "delta"]

    restart(down_s=0.3)
    channel.heartbeat({})
    assert channel.publish(spec.id, "delta", {"text": "b"}) is None
    assert channel.finish(spec.id, "done", {"finish_reason": "length", "text": "ab"}) is False
    assert channel.cancelled(spec.id)  # so the worker's loop stops at its next flush
    entry_id, kind, data = await asyncio.wait_for(anext(reader), timeout=10)
    assert (entry_id, kind, data["code"]) == ("", "error", "queue_restarted")
    assert "restarted" in data["message"]
    assert not await r.exists(events_key(spec.id), job_key(spec.id))  # nothing was re-created
    await r.aclose()


class OutOfMemoryOnce(StandinEngine):
    """The stand-in, except that its first generation fails the way a CUDA allocation does."""

    def __init__(self):
        super().__init__(1000)
        self.failed = False

    def generate(self, prompt_ids, params, should_stop=None):
        events = super().generate(prompt_ids, params, should_stop)
        yield next(events)  # Prefilled
        if not self.failed:
            import torch

            self.failed = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; ...)")
        yield from events


async def test_out_of_memory_is_a_clear_error_and_the_worker_stays_up(jobs, redis_url):
    engine = OutOfMemoryOnce()
    worker = Worker({engine.name: engine}, connect(redis_url), worker_id="oom-test")
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    try:
        events = await run_job(jobs, JobSpec(model=engine.name, prompt="hello", params={"max_new_tokens": 3}))
        assert events[-1][0] == "error"
        error = events[-1][1]
        assert error["code"] == "out_of_memory"
        assert error["message"].startswith("The GPU ran out of memory for this request (5 prompt tokens)")
        assert "\n" not in error["message"]
        events = await run_job(jobs, JobSpec(model=engine.name, prompt="hello", params={"max_new_tokens": 3}))
        assert events[-1] == ("done", events[-1][1]) and events[-1][1]["text"] == "hel"
        assert thread.is_alive()
    finally:
        worker.stopping.set()
        thread.join(timeout=5)


class FailsOnce(StandinEngine):
    """The stand-in, except that its first generation fails with a bug's exception."""

    def __init__(self):
        super().__init__(1000)
        self.failed = False

    def generate(self, prompt_ids, params, should_stop=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("secret internals: /srv/weights/shard-3 index 41 out of range")
        yield from super().generate(prompt_ids, params, should_stop)


async def test_a_failing_job_tells_the_client_its_id_not_the_exception_and_the_worker_stays_up(
    jobs, redis_url, caplog
):
    engine = FailsOnce()
    worker = Worker({engine.name: engine}, connect(redis_url), worker_id="bug-test")
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    try:
        spec = JobSpec(model=engine.name, prompt="hello", params={"max_new_tokens": 3})
        kind, error = (await run_job(jobs, spec))[-1]
        assert kind == "error" and error["code"] == "internal_error"
        assert spec.id in error["message"] and "secret" not in error["message"]
        assert "secret internals" in caplog.text  # the operator finds it in the log, by the job id
        events = await run_job(jobs, JobSpec(model=engine.name, prompt="hello", params={"max_new_tokens": 3}))
        assert events[-1][0] == "done" and events[-1][1]["text"] == "hel"
    finally:
        worker.stopping.set()
        thread.join(timeout=5)


async def test_a_worker_asked_to_stop_finishes_its_job_alive_to_its_readers(jobs, start_worker):
    # docker stop / scaling down: SIGTERM lets the job in progress end. Its heartbeat must outlive the
    # request to stop, or readers call the job lost after HEARTBEAT_TTL_S while it still streams.
    # 14 tokens at 3 a second: 4.7 s, past the heartbeat's 3 s lifetime, with gaps in which readers look
    worker = start_worker(["standin:3"])
    spec = JobSpec(model="standin:3", prompt="abcdefg", params={"max_new_tokens": 14})
    reader = asyncio.create_task(run_job(jobs, spec, timeout_s=30))
    for _ in range(50):
        if (await jobs.status(spec.id)).get("status") == "running":
            break
        await asyncio.sleep(0.1)
    worker.process.terminate()
    events = await reader
    assert events[-1][0] == "done" and events[-1][1]["text"] == "abcdefg" * 2, events[-1]
    assert worker.process.wait(timeout=10) == 0
    assert not await jobs.workers()  # retired once the job was done


async def test_a_redis_failure_mid_job_ends_the_job_with_an_error_not_silence(jobs, redis_url, monkeypatch):
    engine = StandinEngine(200)
    worker = Worker({engine.name: engine}, connect(redis_url), worker_id="flaky-test")
    publish = worker.channel.publish
    failures = iter([True])  # the job's first delta fails past redis-py's retries, once

    def flaky_publish(job_id, kind, data):
        if kind == "delta" and next(failures, False):
            raise redis.exceptions.ConnectionError("Redis went away")
        return publish(job_id, kind, data)

    monkeypatch.setattr(worker.channel, "publish", flaky_publish)
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    try:
        spec = JobSpec(model=engine.name, prompt="hello", params={"max_new_tokens": 20})
        kind, error = (await run_job(jobs, spec))[-1]
        assert kind == "error" and error["code"] == "unavailable" and "try again" in error["message"]
        events = await run_job(jobs, JobSpec(model=engine.name, prompt="hi", params={"max_new_tokens": 2}))
        assert events[-1][0] == "done"  # and the worker serves on
    finally:
        worker.stopping.set()
        thread.join(timeout=5)


def test_two_folders_of_one_name_are_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        worker_main(
            ["--model", str(tmp_path / "runA" / "final"), "--model", str(tmp_path / "runB" / "final/")]
        )
    assert exited.value.code == 2
    assert "would both be served as 'final'" in capsys.readouterr().err


async def test_the_heartbeat_names_a_job_as_it_starts_and_forgets_it_as_it_ends(jobs, redis_url, monkeypatch):
    # Not a beat later (the page's worker pill lagged by up to two seconds): the interval is stretched
    # here so that only the beat a job's start and end ask for can show them in time.
    monkeypatch.setattr(worker_module, "HEARTBEAT_INTERVAL_S", 30.0)
    engine = StandinEngine(20)
    worker = Worker({engine.name: engine}, connect(redis_url), worker_id="prompt-beat")
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()

    async def beat_job(wanted) -> bool:
        for _ in range(20):  # 1 s
            beats = await jobs.workers()
            if beats and beats[0].get("job") == wanted:
                return True
            await asyncio.sleep(0.05)
        return False

    try:
        assert await beat_job(None)
        spec = JobSpec(model=engine.name, prompt="abcdefghij", params={"max_new_tokens": 40})  # 2 s
        await jobs.submit(spec)
        assert await beat_job(spec.id)
        async for _, kind, _ in jobs.events(spec.id, block_ms=50):
            if kind in ("done", "error"):
                break
        assert await beat_job(None)
    finally:
        worker.stopping.set()
        thread.join(timeout=5)


async def test_a_stalled_worker_that_never_comes_back_exits_for_its_supervisor(jobs, redis_url, tmp_path):
    # KOG_STALL_EXIT_S after the stall error, a loop still stuck in the engine means a wedged device:
    # the process exits (75, "try again later") so that docker or systemd restarts it.
    env = {"KOG_STALL_TIMEOUT_S": "0.5", "KOG_STALL_EXIT_S": "0.5"}
    worker = WorkerProcess(redis_url, ["standin:0.05"], tmp_path / "w.log", env=env)  # a token every 20 s
    try:
        worker.wait_ready(timeout_s=30)
        spec = JobSpec(model="standin:0.05", prompt="a", params={"max_new_tokens": 3})
        events = await run_job(jobs, spec, timeout_s=10)
        assert events[-1][0] == "error" and events[-1][1]["code"] == "stalled"
        assert await asyncio.to_thread(worker.process.wait, 10) == 75
    finally:
        worker.stop()
    assert "exiting for a restart" in worker.log_path.read_text()


async def test_a_prompt_over_the_token_cap_is_refused_naming_the_field(jobs, start_worker):
    start_worker([FAST], env={"KOG_MAX_PROMPT_TOKENS": "5"})  # the stand-in: one token per character
    events = await run_job(jobs, JobSpec(model=FAST, prompt="abcdefgh", params={"max_new_tokens": 2}))
    assert events[-1][0] == "error"
    assert events[-1][1]["code"] == "invalid_request" and events[-1][1]["param"] == "prompt"
    assert "8 tokens is over this server's limit of 5" in events[-1][1]["message"]
    events = await run_job(jobs, JobSpec(model=FAST, prompt="abcde", params={"max_new_tokens": 2}))
    assert events[-1][0] == "done" and events[-1][1]["text"] == "ab"


def _wait_for_end(r, job_id: str, timeout_s: float = 60) -> tuple[str, dict]:
    """The sync reader: the job's terminal event, straight from its stream."""
    deadline, after = time.monotonic() + timeout_s, "0-0"
    while time.monotonic() < deadline:
        for _, entries in r.xread({events_key(job_id): after}, block=200) or []:
            for entry_id, fields in entries:
                after = entry_id
                if fields["type"] in ("done", "error"):
                    return fields["type"], json.loads(fields["data"])
    raise TimeoutError(f"job {job_id} did not end within {timeout_s} s")


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_a_clear_error_and_the_next_job_runs(redis_url, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from inference.engine import Engine

    monkeypatch.setenv("KOG_BACKEND", "reference")  # allocates per step, so a full GPU fails inside a job
    engine = Engine.load("tiny-llama", device="cuda")
    r = connect(redis_url)
    worker = Worker({engine.name: engine}, r, worker_id="gpu-oom-test")
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()

    def run(prompt: str) -> tuple[str, dict]:
        spec = JobSpec(model=engine.name, prompt=prompt, params={"max_new_tokens": 8})
        r.hset(job_key(spec.id), mapping={"spec": spec.to_json(), "status": "queued", "model": spec.model})
        r.rpush(queue_key(spec.model), spec.id)
        return _wait_for_end(r, spec.id)

    try:
        long_prompt = "def out_of_memory(): " + "x = 1; " * 200
        assert run(long_prompt)[0] == "done"  # once for real: buffers grown lazily are in the baseline
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()
        hog, chunk = [], 1 << 30
        while chunk >= 1 << 20:  # take every free byte, in ever smaller pieces
            try:
                hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                chunk //= 2
        kind, error = run(long_prompt)
        assert kind == "error" and error["code"] == "out_of_memory", error
        assert error["message"].startswith("The GPU ran out of memory for this request (")
        hog.clear()
        torch.cuda.empty_cache()
        # nothing of the failed step is still held (its traceback is gone), and the worker serves on
        assert torch.cuda.memory_allocated() == baseline
        kind, done = run("def after():")
        assert kind == "done" and done["stats"]["completion_tokens"] >= 1
        assert thread.is_alive()
    finally:
        worker.stopping.set()
        thread.join(timeout=10)


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"model_type": "mistral", "hidden_size": 64}, "unsupported 'mistral'"),
        (None, "config.json"),  # a folder that is no checkpoint
    ],
)
def test_a_model_it_cannot_load_ends_it_at_start_with_one_line_naming_it(tmp_path, redis_url, config, reason):
    model = tmp_path / "my-finetune"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "inference.worker", "--model", str(model), "--redis-url", redis_url],
        env={**os.environ, "LOG_FORMAT": "json"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == worker_module.LOAD_EXIT_CODE == 78, done.stderr
    (line,) = [json.loads(text) for text in (done.stdout + done.stderr).splitlines() if text.strip()]
    assert line["level"] == "ERROR" and str(model) in line["msg"] and reason in line["msg"], line
    assert "Traceback" not in done.stderr
