"""Faults seen from a websocket client of a live daphne: a worker killed with SIGKILL mid-run, and a
Redis restart. The client is told clearly and at once, and the same socket is served again after."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.protocol import HEARTBEAT_TTL_S
from common.redis_server import free_port, start_redis
from tests.support import WebServer, WorkerProcess
from tests.support.sockets import PageSocket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SLOW = "standin:50"  # 50 tokens/s: a 400-token run lasts 8 s, long enough to break something under it


async def test_a_worker_killed_mid_run_is_a_clear_error_and_a_restarted_worker_serves_the_queue(
    start_worker, start_web
):
    worker = start_worker([SLOW])
    web = start_web()
    running, waiting = await PageSocket.open(web.url), await PageSocket.open(web.url)
    await running.generate("abc", max_tokens=400, model=SLOW)
    await running.until(("delta",), timeout_s=20)
    await waiting.generate("xyz", max_tokens=6, model=SLOW)
    assert (await waiting.until(("queue",), timeout_s=10))["position"] == 0

    worker.kill()
    killed_at = time.monotonic()
    error = await running.until(("error", "done"), timeout_s=HEARTBEAT_TTL_S + 5)
    assert error["type"] == "error" and error["code"] == "worker_lost", error
    assert "try again" in error["message"]
    print(f"\nworker_lost {time.monotonic() - killed_at:.1f} s after the SIGKILL")

    start_worker([SLOW])  # the queued job was not lost: the new worker takes it
    done = await waiting.until(("done", "error"), timeout_s=30)
    assert done["type"] == "done" and done["text"] == "xyzxyz"
    # and the socket that saw the failure is served again
    await running.generate("again", max_tokens=5, model=SLOW)
    done = await running.until(("done", "error"), timeout_s=30)
    assert done["type"] == "done" and done["text"] == "again"
    await running.ws.close()
    await waiting.ws.close()


async def test_after_a_redis_restart_clients_are_told_and_the_web_serves_again(tmp_path):
    port = free_port()
    redis_process, url = start_redis(tmp_path / "redis", port=port)
    worker = WorkerProcess(url, [SLOW], tmp_path / "worker.log")
    web = None
    try:
        worker.wait_ready(timeout_s=30)
        web = WebServer(url, tmp_path)
        client = await PageSocket.open(web.url)
        await client.generate("abc", max_tokens=400, model=SLOW)
        await client.until(("delta",), timeout_s=20)

        redis_process.kill()
        redis_process.wait()
        await asyncio.sleep(3)  # longer than a client's own retries: the web side must wait it out
        redis_process, _ = start_redis(tmp_path / "redis", port=port)

        error = await client.until(("error", "done"), timeout_s=30)
        assert error["type"] == "error" and error["code"] == "queue_restarted", error
        assert "run it again" in error["message"]

        worker.wait_ready(timeout_s=20)  # the worker is back in the new Redis
        await client.generate("fresh", max_tokens=5, model=SLOW)
        done = await client.until(("done", "error"), timeout_s=30)
        assert done["type"] == "done" and done["text"] == "fresh", done
        await client.ws.close()
        assert worker.process.poll() is None and web.process.poll() is None
    finally:
        if web is not None:
            web.stop()
        worker.stop()
        redis_process.kill()
        redis_process.wait()
