"""A web process killed with SIGKILL mid-run: its jobs do not run on for nobody. Every follower of a job (a
page's socket, an API request) holds a lease on it in Redis; once none is live for the job's grace, its
worker cancels it (common/protocol.py, followers). Live daphnes, a real worker, the official `openai`
client and websocket clients of the page's protocol, against the suite's Redis."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest
import redis

from common.protocol import LEASE_TTL_S, JobClient, JobSpec, connect, job_key
from tests.support.sockets import PageSocket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SLOW = "standin:40"  # 40 tokens/s: a 400-token run lasts 10 s, long enough to kill a web process under it
MARGIN_S = 3.0  # a flush, a poll, a loaded CI machine


def status(redis_url: str, job_id: str) -> str | None:
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        return r.hget(job_key(job_id), "status")


async def wait_for_status(redis_url: str, job_id: str, wanted: str, timeout_s: float) -> float:
    """Seconds until the job's status is `wanted`; fails after timeout_s."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if status(redis_url, job_id) == wanted:
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"job {job_id} is {status(redis_url, job_id)!r}, not {wanted!r}, after {timeout_s} s"
    )


async def the_worker_serves_the_next_job(redis_url: str) -> None:
    jobs = JobClient(connect(redis_url, use_asyncio=True))
    spec = JobSpec(model=SLOW, prompt="next", params={"max_new_tokens": 8})
    await jobs.submit(spec)
    async with asyncio.timeout(10):  # not behind the rest of the killed web's run
        kind, data = await jobs.outcome(spec.id, known=True)
    assert kind == "done" and data["text"] == "nextnext", (kind, data)
    await jobs.r.aclose()


async def test_a_web_killed_mid_api_stream_has_its_job_cancelled_and_the_worker_serves_on(
    redis_url, start_worker, start_web
):
    start_worker([SLOW])
    web = start_web()
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="unused", max_retries=0, timeout=30)
    seen: dict = {"chunks": 0, "job": None, "error": None}
    enough = threading.Event()

    def stream():
        try:
            for chunk in client.completions.create(model=SLOW, prompt="abc", max_tokens=800, stream=True):
                seen["job"] = chunk.id.removeprefix("cmpl-")
                seen["chunks"] += 1
                if seen["chunks"] == 5:
                    enough.set()
        except Exception as exc:  # the server vanished under it
            seen["error"] = exc
        enough.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert await asyncio.to_thread(enough.wait, 20) and seen["chunks"] >= 5, seen
    assert status(redis_url, seen["job"]) == "running"

    web.process.kill()  # SIGKILL: no cleanup of any kind runs in the web process
    took = await wait_for_status(redis_url, seen["job"], "cancelled", LEASE_TTL_S + MARGIN_S)
    print(f"\nthe API job was cancelled {took:.1f} s after its web process was killed")
    await asyncio.to_thread(reader.join, 10)
    assert seen["error"] is not None  # the client saw its connection drop, not an end
    await the_worker_serves_the_next_job(redis_url)


async def test_a_web_killed_mid_page_stream_has_its_job_cancelled_after_the_grace(
    redis_url, start_worker, start_web
):
    grace_s = 1.0
    start_worker([SLOW])
    web = start_web(env={"PLAYGROUND_ORPHAN_GRACE_S": str(grace_s)})
    page = await PageSocket.open(web.url)
    await page.send(type="generate", prompt="abc", model=SLOW, max_tokens=800)  # 20 s, unless cancelled
    job_id = (await page.until(("started",), timeout_s=20))["job_id"]
    await page.until(("delta",), timeout_s=10)

    web.process.kill()
    took = await wait_for_status(redis_url, job_id, "cancelled", LEASE_TTL_S + grace_s + MARGIN_S)
    print(f"\nthe page's job was cancelled {took:.1f} s after its web process was killed")
    await the_worker_serves_the_next_job(redis_url)


async def test_a_page_that_reloads_on_another_web_within_the_grace_resumes_after_its_web_was_killed(
    redis_url, start_worker, start_web
):
    # The lease of the killed web lapses (LEASE_TTL_S); the reload comes after that, within the grace.
    start_worker([SLOW])
    env = {"PLAYGROUND_ORPHAN_GRACE_S": "8"}
    first, second = start_web(env=env), start_web(env=env)
    page = await PageSocket.open(first.url)
    await page.send(type="generate", prompt="abcdefghij", model=SLOW, max_tokens=400)
    job_id = (await page.until(("started",), timeout_s=20))["job_id"]
    await page.until(("delta",), timeout_s=10)

    first.process.kill()
    await asyncio.sleep(LEASE_TTL_S + 1.5)
    assert status(redis_url, job_id) == "running"  # unfollowed, within its grace
    reloaded = await PageSocket.open(second.url)
    await reloaded.send(type="resume", job_id=job_id, after=page.last_id())
    done = await reloaded.until(("done", "error"), timeout_s=30)
    assert done["type"] == "done" and done["finish_reason"] == "length", done
    assert page.text() + reloaded.text() == done["text"] == ("abcdefghij" * 40)
    await reloaded.ws.close()


async def test_a_job_two_pages_follow_runs_on_when_the_web_of_one_is_killed(
    redis_url, start_worker, start_web
):
    start_worker([SLOW])
    env = {"PLAYGROUND_ORPHAN_GRACE_S": "0.5"}  # short: only the other page's lease keeps the job
    first, second = start_web(env=env), start_web(env=env)
    page = await PageSocket.open(first.url)
    await page.send(type="generate", prompt="xyz", model=SLOW, max_tokens=400)
    job_id = (await page.until(("started",), timeout_s=20))["job_id"]
    await page.until(("delta",), timeout_s=10)
    other = await PageSocket.open(second.url)  # the same run, open in a second tab served by another process
    await other.send(type="resume", job_id=job_id, after="0-0")
    await other.until(("delta",), timeout_s=10)

    first.process.kill()
    done = await other.until(("done", "error"), timeout_s=30)
    assert done["type"] == "done" and done["finish_reason"] == "length", done
    assert other.text() == done["text"] == ("xyz" * 134)[:400]
    assert status(redis_url, job_id) == "done"
    await other.ws.close()
