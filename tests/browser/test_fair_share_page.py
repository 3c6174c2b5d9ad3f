"""What a visitor sees of the fair share: a queued run's place with an estimated wait (and word when the wait
outruns it), and a tab over the address's cap on open pages told so (and not reconnecting in a loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time

import pytest
import redis.asyncio as aioredis

from common.protocol import JobClient, JobSpec
from tests.support import WebServer, WorkerProcess
from tests.support.page import generate, open_playground

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

MODEL = "standin:20"


@pytest.fixture(scope="module")
def server(redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fair")
    worker = WorkerProcess(redis_server, [MODEL], tmp / "worker.log")
    web = None
    try:
        worker.wait_ready()
        web = WebServer(redis_server, tmp, {"PLAYGROUND_MAX_SOCKETS_PER_IP": "1"})
        yield web
    finally:
        if web is not None:
            web.stop()
        worker.stop()


def in_thread(coroutine):
    """Run `coroutine` to its end in a thread of its own: playwright's sync API holds this thread's loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def on_queue(redis_url: str, action: str, job_id: str = "") -> str:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    client = JobClient(r)
    try:
        if action == "busy":  # the model measured at 6 s a job, and its worker busy for a long while
            await client.record_speed(MODEL, {"decode_tok_s": 20.0, "total_ms": 6000.0})
            return await client.submit(JobSpec(model=MODEL, prompt="b", params={"max_new_tokens": 100_000}))
        await client.cancel(job_id)
        return job_id
    finally:
        await r.aclose()


def test_a_queued_run_shows_its_place_and_an_estimated_wait(server, page, redis_server):
    busy = in_thread(on_queue(redis_server, "busy"))
    try:
        open_playground(page, server.url, MODEL)
        generate(page, "abc", 3)
        page.wait_for_selector("#state[data-state=queued]", timeout=15_000)
        page.wait_for_function("() => /about \\d+ s/.test(document.getElementById('state').textContent)")
        assert re.search(r"next in line, about 6 s", page.text_content("#state")), page.text_content("#state")
        assert page.text_content("#queue") == "0"  # the meter counts the jobs ahead
        # the estimate is an average job's length: once the wait outruns it, the line says so (once)
        page.wait_for_selector("#state:text('next in line, longer than the usual job')", timeout=15_000)
        assert page.get_attribute("#state", "data-state") == "queued"
    finally:
        in_thread(on_queue(redis_server, "cancel", busy))
    page.wait_for_selector("#state[data-state=done]", timeout=30_000)


def test_a_tab_over_the_addresss_cap_is_told_and_retries_slowly(server, page, browser):
    open_playground(page, server.url, MODEL)  # the address's one page
    second = browser.new_context().new_page()
    tries = []
    second.on("websocket", lambda ws: tries.append(time.monotonic()))
    second.goto(server.url)
    second.wait_for_function(
        "() => document.getElementById('note').textContent.includes('at most 1 open pages per address')"
    )
    first_try = tries[0]
    second.wait_for_timeout(4000)
    # at the slowest pace (3 s), not the first pace after an open (250 ms): a tight loop would try ~16 times
    assert len([t for t in tries if t - first_try < 4]) <= 3, [round(t - first_try, 2) for t in tries]
    second.wait_for_function(
        "() => document.getElementById('worker-text').textContent.includes('too many open pages')"
    )
    assert "unreachable" not in second.text_content("#worker-text")
    # a request made meanwhile waits, saying why, whether the click met a socket about to be closed or none
    second.fill("#prompt", "abc")
    second.fill("#max-tokens", "3")
    second.click("#generate")
    second.wait_for_function(
        "() => document.getElementById('state').textContent.includes('open pages per address')"
    )
    second.wait_for_timeout(3500)  # a try or two more while the first page is still open: still waiting
    assert second.get_attribute("#state", "data-state") == "sending", second.text_content("#state")
    page.close()  # the address's page closes: the next try is taken, and the request goes out then
    second.wait_for_selector("#state[data-state=done]", timeout=30_000)
    assert second.text_content("#output") == "abc"
    second.context.close()
