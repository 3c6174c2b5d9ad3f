"""The page's websocket (playground/consumers.py) against the suite's Redis and real worker processes.

The stand-in engine (`standin:<tokens/s>`, which echoes its prompt) runs where a test needs a known
output or a generation that is still going when the test acts (stop, reconnect, kill); the tiny
model runs the plain path end to end.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from channels.testing import WebsocketCommunicator

from inference.presets import PRESETS
from playground import jobs
from playground.models import Generation
from tests.support import SAME_ORIGIN, e2e_model

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

TERMINAL = ("done", "error")


@pytest.fixture(autouse=True)
async def web_settings(settings, redis_url):
    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_STATUS_INTERVAL_S = 0.2
    settings.PLAYGROUND_ORPHAN_GRACE_S = 0.5
    yield settings
    await jobs.job_client().r.aclose()


async def connect() -> WebsocketCommunicator:
    from playground.asgi import application

    communicator = WebsocketCommunicator(application, "/ws/generate/", headers=SAME_ORIGIN)
    connected, _ = await communicator.connect()
    assert connected
    return communicator


async def next_frame(communicator, timeout: float = 30, skip=("workers",)) -> dict:
    while True:
        frame = await communicator.receive_json_from(timeout=timeout)
        if frame["type"] not in skip:
            return frame


async def run_to_end(communicator, timeout: float = 60) -> list[dict]:
    """Job frames until done or error."""
    frames = []
    while not frames or frames[-1]["type"] not in TERMINAL:
        frames.append(await next_frame(communicator, timeout))
    return frames


def streamed_text(frames: list[dict]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "delta")


def assert_entry_ids_increase(frames: list[dict]) -> None:
    ids = [tuple(map(int, f["id"].split("-"))) for f in frames if f.get("id")]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_generate_goes_queue_tokens_done_and_is_saved(start_worker):
    start_worker()
    model = e2e_model()
    model = model if model in PRESETS else Path(model).name  # a checkpoint is served by its folder's name
    communicator = await connect()
    workers = await communicator.receive_json_from(timeout=10)
    assert workers["type"] == "workers" and workers["up"] is True
    assert model in [m["name"] for m in workers["models"]]

    await communicator.send_json_to(
        {"type": "generate", "prompt": "def add(a, b):", "model": model, "max_tokens": 12}
    )
    frames = await run_to_end(communicator)
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "queue" and kinds[1] == "started" and kinds[2] == "prefilled"
    assert kinds[-1] == "done" and set(kinds[3:-1]) == {"delta"}
    assert len({f["job_id"] for f in frames}) == 1
    assert_entry_ids_increase(frames)

    done = frames[-1]
    deltas = [f for f in frames if f["type"] == "delta"]
    assert [d["n"] for d in deltas] == sorted(d["n"] for d in deltas)
    assert deltas[-1]["n"] == done["stats"]["completion_tokens"] <= 12
    assert streamed_text(frames) == done["text"]
    assert done["finish_reason"] in ("stop", "length")
    assert done["stats"]["prompt_tokens"] == frames[2]["prompt_tokens"] > 0
    assert "token_times" not in done["stats"]

    saved = await Generation.objects.aget(job_id=done["job_id"])
    assert done["share_url"] == f"/g/{saved.id}"
    assert (saved.output, saved.prompt, saved.model, saved.source) == (
        done["text"],
        "def add(a, b):",
        model,
        "web",
    )
    assert saved.completion_tokens == done["stats"]["completion_tokens"]
    await communicator.disconnect()


async def test_two_concurrent_clients_each_get_their_own_complete_output(start_worker):
    start_worker(models=["standin:2000"])
    prompts = ["alpha " * 40, "omega " * 40]
    clients = [await connect() for _ in prompts]
    for client, prompt in zip(clients, prompts, strict=True):
        await client.send_json_to(
            {"type": "generate", "prompt": prompt, "model": "standin:2000", "max_tokens": len(prompt)}
        )
    results = await asyncio.gather(*(run_to_end(c) for c in clients))
    for frames, prompt in zip(results, prompts, strict=True):
        assert frames[-1]["type"] == "done"
        assert streamed_text(frames) == frames[-1]["text"] == prompt
    assert results[0][0]["job_id"] != results[1][0]["job_id"]
    for client in clients:
        await client.disconnect()


async def test_stop_ends_the_run_and_keeps_the_partial_text(start_worker):
    start_worker(models=["standin:50"])
    communicator = await connect()
    prompt = "0123456789" * 100
    await communicator.send_json_to(
        {"type": "generate", "prompt": prompt, "model": "standin:50", "max_tokens": 1000}
    )
    frames = []
    while not any(f["type"] == "delta" for f in frames):
        frames.append(await next_frame(communicator))
    await communicator.send_json_to({"type": "stop"})
    frames += await run_to_end(communicator)
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert 0 < done["stats"]["completion_tokens"] < 1000
    assert streamed_text(frames) == done["text"] == prompt[: done["stats"]["completion_tokens"]]
    saved = await Generation.objects.aget(job_id=done["job_id"])
    assert saved.finish_reason == "cancelled" and saved.output == done["text"]

    # the socket serves the next run
    await communicator.send_json_to(
        {"type": "generate", "prompt": "again", "model": "standin:50", "max_tokens": 5}
    )
    assert (await run_to_end(communicator))[-1]["text"] == "again"
    await communicator.disconnect()


async def test_reconnect_mid_stream_resumes_without_gap_or_duplicate(start_worker):
    start_worker(models=["standin:1000"])
    prompt = "".join(chr(ord("a") + i % 26) for i in range(800))
    first = await connect()
    await first.send_json_to(
        {"type": "generate", "prompt": prompt, "model": "standin:1000", "max_tokens": 800}
    )
    before = []
    while sum(f["type"] == "delta" for f in before) < 3:
        before.append(await next_frame(first))
    await first.disconnect()  # the tab lost its connection mid-stream
    last = [f for f in before if f.get("id")][-1]

    second = await connect()
    await second.send_json_to({"type": "resume", "job_id": last["job_id"], "after": last["id"]})
    after = await run_to_end(second)
    done = after[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert streamed_text(before) + streamed_text(after) == done["text"] == prompt
    # the first delta after the resume continues the count exactly where the first socket stopped
    first_resumed = next(f for f in after if f["type"] == "delta")
    last_seen = [f for f in before if f["type"] == "delta"][-1]
    assert first_resumed["n"] - len(first_resumed["text"]) == last_seen["n"]
    assert_entry_ids_increase(before + after)

    # resuming a finished job from the start replays it whole, once
    await second.send_json_to({"type": "resume", "job_id": last["job_id"], "after": "0-0"})
    replay = await run_to_end(second)
    assert streamed_text(replay) == prompt and replay[-1]["share_url"] == done["share_url"]
    assert await Generation.objects.filter(job_id=last["job_id"]).acount() == 1
    await second.disconnect()


async def test_done_stats_carry_the_queue_wait_also_for_a_socket_that_resumed(start_worker):
    # the worker's clock (ttft_ms among it) starts when it takes the job: the wait before it comes apart
    start_worker(models=["standin:1000"])
    first = await connect()
    await first.send_json_to(
        {"type": "generate", "prompt": "q" * 400, "model": "standin:1000", "max_tokens": 400}
    )
    before = []
    while not any(f["type"] == "delta" for f in before):
        before.append(await next_frame(first))
    started = next(f for f in before if f["type"] == "started")
    await first.disconnect()

    second = await connect()  # resumed after its `started` event: the wait comes from the job's record
    last = [f for f in before if f.get("id")][-1]
    await second.send_json_to({"type": "resume", "job_id": last["job_id"], "after": last["id"]})
    done = (await run_to_end(second))[-1]
    assert done["type"] == "done" and done["stats"]["queue_ms"] == pytest.approx(started["queue_ms"])

    await second.send_json_to({"type": "generate", "prompt": "w", "model": "standin:1000", "max_tokens": 1})
    frames = await run_to_end(second)
    started = next(f for f in frames if f["type"] == "started")
    assert frames[-1]["stats"]["queue_ms"] == started["queue_ms"] >= 0
    await second.disconnect()


async def test_killed_worker_gives_a_clear_error_and_the_next_request_is_served(start_worker):
    worker = start_worker(models=["standin:100"])
    communicator = await connect()
    await communicator.send_json_to(
        {"type": "generate", "prompt": "slow " * 200, "model": "standin:100", "max_tokens": 1000}
    )
    while (await next_frame(communicator))["type"] != "delta":
        pass
    worker.kill()
    frames = await asyncio.wait_for(run_to_end(communicator, timeout=5), timeout=5)  # the bound
    error = frames[-1]
    assert error["type"] == "error" and error["code"] == "worker_lost"
    assert "try again" in error["message"]

    start_worker(models=["standin:100"])
    await communicator.send_json_to(
        {"type": "generate", "prompt": "back", "model": "standin:100", "max_tokens": 4}
    )
    frames = await run_to_end(communicator)
    assert frames[-1]["type"] == "done" and frames[-1]["text"] == "back"
    await communicator.disconnect()


async def test_bad_frames_get_an_error_and_the_socket_stays_usable(start_worker, settings):
    start_worker(models=["standin:1000"])
    communicator = await connect()

    async def error_for(payload) -> dict:
        if isinstance(payload, str):
            await communicator.send_to(text_data=payload)
        else:
            await communicator.send_json_to(payload)
        frame = await next_frame(communicator, timeout=10)
        assert frame["type"] == "error", frame
        return frame

    assert (await error_for("not json"))["code"] == "bad_frame"
    assert (await error_for([1, 2]))["code"] == "bad_frame"
    for _ in range(2):  # JSON nested past the decoder's recursion: an error frame each time, no traceback
        deep = await error_for('{"type": "generate", "x": ' + "[" * 5000 + "]" * 5000 + "}")
        assert deep["code"] == "bad_frame" and "nested" in deep["message"]
    assert "type" in (await error_for({"type": "launch"}))["message"]
    generate = {"type": "generate", "prompt": "ok", "model": "standin:1000"}
    cases = {
        "prompt": {**generate, "prompt": "   "},
        # (numbers out of range are clamped, see tests/web/test_fuzz.py; the wrong type is an error)
        "temperature": {**generate, "temperature": "hot"},
        "top_p": {**generate, "top_p": [0.5]},
        "max_tokens": {**generate, "max_tokens": 2.5},
        "model": {**generate, "model": "no-such-model"},
        "system_prompt": {**generate, "system_prompt": 3},
        "job_id": {"type": "resume", "job_id": "../etc", "after": "0-0"},
        "after": {"type": "resume", "job_id": "abc", "after": "yesterday"},
    }
    for field, payload in cases.items():
        error = await error_for(payload)
        assert (error["code"], error["param"]) == ("invalid_request", field), error
        assert error["message"].startswith(f"{field}: ")
    assert (await error_for({"type": "resume", "job_id": "f" * 32, "after": "0-0"}))["code"] == "unknown_job"

    await communicator.send_json_to({"type": "stop"})  # nothing running: ignored
    await communicator.send_json_to({**generate, "max_tokens": 2, "temperature": 0.5, "top_p": 0.9})
    frames = await run_to_end(communicator)
    assert frames[0]["type"] == "queue" and frames[-1]["text"] == "ok"
    await communicator.disconnect()


async def test_resuming_a_job_whose_record_lost_its_spec_is_unknown_not_a_crash(start_worker, redis_url):
    # A status written just as a job's record expired leaves a record with no spec behind: resuming it is
    # an unknown job, and the socket stays usable.
    import redis.asyncio as aioredis

    from common.protocol import job_key

    start_worker(models=["standin:1000"])
    stub = "e" * 32
    client = aioredis.from_url(redis_url)
    await client.hset(job_key(stub), mapping={"status": "cancelled"})
    await client.aclose()
    communicator = await connect()
    await communicator.send_json_to({"type": "resume", "job_id": stub, "after": "0-0"})
    frame = await next_frame(communicator, timeout=10)
    assert (frame["type"], frame["code"]) == ("error", "unknown_job"), frame
    await communicator.send_json_to(
        {"type": "generate", "prompt": "ok", "model": "standin:1000", "max_tokens": 2}
    )
    frames = await run_to_end(communicator)
    assert frames[-1]["type"] == "done" and frames[-1]["text"] == "ok"
    await communicator.disconnect()


async def test_a_second_generate_while_one_runs_is_refused(start_worker):
    start_worker(models=["standin:50"])
    communicator = await connect()
    await communicator.send_json_to(
        {"type": "generate", "prompt": "x" * 400, "model": "standin:50", "max_tokens": 400}
    )
    assert (await next_frame(communicator))["type"] == "queue"
    await communicator.send_json_to({"type": "generate", "prompt": "y", "model": "standin:50"})
    frame = await next_frame(communicator, skip=("workers", "started", "prefilled", "delta"))
    assert frame["type"] == "error" and frame["code"] == "busy"
    await communicator.send_json_to({"type": "stop"})
    assert (await run_to_end(communicator))[-1]["finish_reason"] == "cancelled"
    await communicator.disconnect()


async def test_queue_position_then_stop_while_queued(start_worker):
    start_worker(models=["standin:50"])
    busy, waiting = await connect(), await connect()
    await busy.send_json_to(
        {"type": "generate", "prompt": "b" * 600, "model": "standin:50", "max_tokens": 600}
    )
    while (await next_frame(busy))["type"] != "delta":
        pass
    await waiting.send_json_to({"type": "generate", "prompt": "w", "model": "standin:50"})
    queued = await next_frame(waiting)
    assert queued["type"] == "queue" and queued["position"] == 0 and queued["workers"] == 1
    await waiting.send_json_to({"type": "stop"})
    done = await next_frame(waiting, skip=("workers", "queue"))
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert done["stats"] is None and done["share_url"] is None  # never started: nothing to share
    await busy.send_json_to({"type": "stop"})
    await run_to_end(busy)
    for communicator in (busy, waiting):
        await communicator.disconnect()


async def test_a_job_whose_page_closed_is_cancelled_after_the_grace_period(start_worker):
    start_worker(models=["standin:100"])
    communicator = await connect()
    await communicator.send_json_to(
        {"type": "generate", "prompt": "z" * 900, "model": "standin:100", "max_tokens": 900}
    )
    job_id = (await next_frame(communicator))["job_id"]
    await communicator.disconnect()
    client = jobs.job_client()
    for _ in range(50):
        await asyncio.sleep(0.1)
        if (await client.status(job_id)).get("status") == "cancelled":
            break
    assert (await client.status(job_id))["status"] == "cancelled"


async def test_a_job_that_ends_after_its_page_closed_is_counted(start_worker, settings):
    from playground import metrics

    settings.PLAYGROUND_ORPHAN_GRACE_S = 5  # longer than the job: it ends while nobody follows it
    start_worker(models=["standin:50"])
    tokens = metrics.REGISTRY.get_sample_value("kog_generated_tokens_total", {"model": "standin:50"}) or 0
    communicator = await connect()
    await communicator.send_json_to(
        {"type": "generate", "prompt": "y" * 40, "model": "standin:50", "max_tokens": 40}
    )
    job_id = (await next_frame(communicator))["job_id"]
    await communicator.disconnect()  # the tab closes; the job ends within the grace, seen by no socket
    client = jobs.job_client()
    for _ in range(100):
        await asyncio.sleep(0.1)
        counted = metrics.REGISTRY.get_sample_value("kog_generated_tokens_total", {"model": "standin:50"})
        if counted == tokens + 40:
            break
    assert (await client.status(job_id))["status"] == "done"
    assert (
        metrics.REGISTRY.get_sample_value("kog_generated_tokens_total", {"model": "standin:50"})
        == tokens + 40
    )


async def test_worker_status_follows_workers_coming_and_going(start_worker):
    communicator = await connect()
    first = await communicator.receive_json_from(timeout=10)
    assert first["type"] == "workers" and first["up"] is False
    worker = start_worker(models=["standin:50"])
    up = await communicator.receive_json_from(timeout=10)
    assert up["up"] is True and up["count"] == 1 and up["models"][0]["name"] == "standin:50"
    assert up["models"][0]["chat"] is False
    worker.stop()  # a clean stop retires the heartbeat at once
    down = await communicator.receive_json_from(timeout=10)
    assert down["up"] is False
    await communicator.disconnect()
