"""Redis lost under a running or queued job, as the API and the page see it: a retryable error naming what
happened (the queue restarted and lost the job, or stayed unreachable past PLAYGROUND_REDIS_RETRY_S), never
a 500 with a traceback nor an "unknown job". Each test runs its own Redis, which it stops or restarts."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from channels.testing import WebsocketCommunicator

from common.protocol import job_key
from common.redis_server import free_port, start_redis
from playground import jobs
from tests.support import SAME_ORIGIN, WebServer, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SLOW = "standin:30"  # 30 tokens/s: a 600-token run lasts 20 s, long enough to take Redis away under it


@pytest.fixture
def own_redis(tmp_path):
    """A Redis this test may stop and start again on the same port (the suite's one is shared)."""
    port = free_port()
    state = {"process": start_redis(tmp_path / "redis", port=port)[0]}

    def stop() -> None:
        state["process"].kill()
        state["process"].wait()

    def start() -> None:
        state["process"] = start_redis(tmp_path / "redis", port=port)[0]

    yield f"redis://127.0.0.1:{port}/0", stop, start
    stop()


@pytest.mark.parametrize(
    "down_s, retry_s, code",
    [
        (None, 2, "queue_down"),  # away past PLAYGROUND_REDIS_RETRY_S: it never came back in time
        # back within it, but empty: the job is gone (3 s outlasts the Redis client's own retries, so the
        # request reads its job again from the last event, as it would after a network fault)
        (3.0, 10, "queue_restarted"),
    ],
)
def test_an_api_request_that_loses_redis_gets_a_retryable_error_not_a_500(
    own_redis, tmp_path, down_s, retry_s, code
):
    url, stop_redis, start_redis_again = own_redis
    worker = WorkerProcess(url, [SLOW], tmp_path / "worker.log")
    web = None
    try:
        worker.wait_ready(timeout_s=30)
        web = WebServer(url, tmp_path, env={"PLAYGROUND_REDIS_RETRY_S": str(retry_s)})
        streamed: list[str] = []
        first_chunk = threading.Event()
        outcome: dict = {}

        def stream():  # raw SSE, to see the error chunk and the [DONE] after it
            body = {"model": SLOW, "prompt": "abc", "max_tokens": 600, "stream": True}
            with httpx.stream("POST", f"{web.url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        streamed.append(line.removeprefix("data: "))
                        first_chunk.set()

        def whole():  # queued behind the stream (one worker): it waits on an event-less job
            client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                client.completions.create(model=SLOW, prompt="xyz", max_tokens=5)
            except openai.APIStatusError as exc:
                outcome["status"], outcome["body"] = exc.status_code, exc.body

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        threads[0].start()
        assert first_chunk.wait(20)
        threads[1].start()
        time.sleep(1.0)  # the second job is queued

        stop_redis()
        if down_s is not None:
            time.sleep(down_s)
            start_redis_again()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()

        assert streamed[-1] == "[DONE]"
        error = json.loads(streamed[-2])["error"]
        assert error["code"] == code and error["type"] == "server_error", error
        assert "run it again" in error["message"]
        assert outcome["status"] == 503, outcome
        assert outcome["body"]["code"] == code, outcome
        # a fault outside the server, not a bug: warnings in the log (the refusal's own naming its code), no
        # traceback, no ERROR line
        log_lines = [
            json.loads(line) for line in web.log_path.read_text().splitlines() if line.startswith("{")
        ]
        errors = [line for line in log_lines if line["level"] in ("ERROR", "CRITICAL")]
        assert errors == []
        assert any(line["level"] == "WARNING" and f"answered 503 {code}" in line["msg"] for line in log_lines)
        assert "Traceback" not in web.log_path.read_text()
        assert any(line["level"] == "WARNING" and "lost redis" in line["msg"] for line in log_lines)
    finally:
        if web is not None:
            web.stop()
        worker.stop()
        if down_s is None:
            start_redis_again()  # for the fixture to stop


@pytest.fixture
async def page_settings(settings, own_redis):
    url = own_redis[0]
    settings.REDIS_URL = url
    settings.PLAYGROUND_STATUS_INTERVAL_S = 0.2
    yield settings
    await jobs.job_client().r.aclose()


async def connect() -> WebsocketCommunicator:
    from playground.asgi import application

    communicator = WebsocketCommunicator(application, "/ws/generate/", headers=SAME_ORIGIN)
    assert (await communicator.connect())[0]
    return communicator


async def frame_of(communicator, kinds: tuple[str, ...], timeout_s: float = 30) -> dict:
    async with asyncio.timeout(timeout_s):
        while (frame := await communicator.receive_json_from(timeout=timeout_s))["type"] not in kinds:
            pass
    return frame


@pytest.mark.django_db(transaction=True)
async def test_a_queued_page_job_lost_to_a_redis_restart_is_queue_restarted_not_unknown(
    page_settings, own_redis, tmp_path
):
    url, stop_redis, start_redis_again = own_redis
    worker = WorkerProcess(url, [SLOW], tmp_path / "worker.log")
    try:
        await asyncio.to_thread(worker.wait_ready, 30)
        running, queued = await connect(), await connect()
        await running.send_json_to({"type": "generate", "prompt": "abc", "model": SLOW, "max_tokens": 600})
        await frame_of(running, ("delta",))
        await queued.send_json_to({"type": "generate", "prompt": "xyz", "model": SLOW, "max_tokens": 5})
        job_id = (await frame_of(queued, ("queue",)))["job_id"]

        stop_redis()
        await asyncio.sleep(3)  # longer than the client's own retries: the socket reads its job again
        start_redis_again()

        for communicator in (running, queued):
            error = await frame_of(communicator, ("error", "done"))
            assert (error["type"], error["code"]) == ("error", "queue_restarted"), error
            assert "run it again" in error["message"]
        r = jobs.job_client().r
        assert not await r.exists(job_key(job_id))  # no stub record written into the new Redis
        for communicator in (running, queued):
            await communicator.disconnect()
    finally:
        worker.stop()


@pytest.mark.django_db(transaction=True)
async def test_a_page_whose_redis_stays_away_is_told_to_run_it_again(page_settings, own_redis, tmp_path):
    url, stop_redis, start_redis_again = own_redis
    page_settings.PLAYGROUND_REDIS_RETRY_S = 1
    worker = WorkerProcess(url, [SLOW], tmp_path / "worker.log")
    try:
        await asyncio.to_thread(worker.wait_ready, 30)
        page = await connect()
        await page.send_json_to({"type": "generate", "prompt": "abc", "model": SLOW, "max_tokens": 600})
        await frame_of(page, ("delta",))
        stop_redis()
        error = await frame_of(page, ("error", "done"))
        # nothing could resume it: the job's state was out of reach, and its worker stops an unfollowed job
        assert (error["type"], error["code"]) == ("error", "unavailable"), error
        assert error["message"] == "the job queue was unreachable; run it again"
        await page.disconnect()
    finally:
        worker.stop()
        start_redis_again()  # for the fixture to stop


def test_a_bad_request_is_a_400_at_once_while_the_queue_is_down(own_redis, tmp_path):
    url, stop_redis, _ = own_redis
    web = WebServer(url, tmp_path)
    try:
        stop_redis()
        started = time.monotonic()
        bad = httpx.post(f"{web.url}/v1/completions", json={"model": "m", "prompt": "a", "temperature": "hot"},
                         timeout=30)  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
        assert time.monotonic() - started < 2  # not after the Redis client's retries
        good = httpx.post(f"{web.url}/v1/completions", json={"model": "m", "prompt": "a"}, timeout=60)
        assert good.status_code == 503 and good.json()["error"]["code"] == "queue_down", good.text
    finally:
        web.stop()
