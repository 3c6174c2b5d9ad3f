"""A fair share per visitor on a live daphne: a cap on one address's open pages and on its jobs queued or
running, and a queue that serves visitors in turn. Visitors are loopback addresses (127.0.0.1, 127.0.0.2)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis

from common.protocol import job_key
from tests.support.sockets import PageSocket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "standin:100"  # 100 tokens/s: a 300-token job holds the worker 3 s
SHARE = {"PLAYGROUND_MAX_JOBS_PER_VISITOR": "2", "PLAYGROUND_MAX_SOCKETS_PER_IP": "8"}


async def first_answer(socket: PageSocket) -> dict:
    """The socket's first job frame, or the error that refused it (a closed socket counts as refused)."""
    try:
        return await socket.until(("queue", "error"), timeout_s=30)
    except Exception:  # noqa: BLE001 - closed by the server before a frame came
        return {"type": "error", "code": "closed"}


async def test_one_address_with_30_pages_does_not_keep_a_second_visitor_waiting(
    start_worker, start_web, redis_url
):
    start_worker([MODEL])
    web = start_web(SHARE)
    greedy = []
    for _ in range(30):
        socket = await PageSocket.open(web.url, "127.0.0.1")
        greedy.append(socket)
    # a refused page hears so at once; an open one hears nothing (the wait runs out)
    hello = await asyncio.gather(*(s.until(("error",), timeout_s=3) for s in greedy), return_exceptions=True)
    refused = [s for s, frame in zip(greedy, hello, strict=True) if isinstance(frame, dict)]
    assert {f["code"] for f in hello if isinstance(f, dict)} == {"too_many_sockets"}
    assert len(refused) == 22  # 8 pages open per address
    for socket in refused:  # closed by the server in an application's code: autobahn refuses 1008 from one
        with contextlib.suppress(Exception):
            await asyncio.wait_for(socket.ws.wait_closed(), 10)
        assert socket.ws.close_code == 4008
    open_pages = [s for s in greedy if s not in refused]
    for socket in open_pages:
        await socket.generate("a", max_tokens=300, model=MODEL)
    answers = [await first_answer(s) for s in open_pages]
    admitted = [a["job_id"] for a in answers if a["type"] == "queue"]
    assert len(admitted) == 2, answers  # one running, one queued: the rest told to wait for them
    assert {a["code"] for a in answers if a["type"] == "error"} == {"too_many_jobs"}

    # The greedy address keeps asking from its six other pages as its jobs end ...
    async def keep_asking(socket: PageSocket) -> None:
        while True:
            await socket.generate("a", max_tokens=300, model=MODEL)
            answer = await first_answer(socket)
            if answer["type"] == "queue":
                admitted.append(answer["job_id"])
                return
            await asyncio.sleep(0.2)

    waiting = [s for s, a in zip(open_pages, answers, strict=True) if a["type"] == "error"]
    askers = [asyncio.create_task(keep_asking(s)) for s in waiting]
    # ... and a second visitor asks once for a short run: served before the greedy one's second job
    other = await PageSocket.open(web.url, "127.0.0.2")
    await other.generate("b", max_tokens=3, model=MODEL)
    mine = await other.until(("queue",), timeout_s=30)
    done = await other.until(("done", "error"), timeout_s=60)
    assert done["type"] == "done", done
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    # one worker, one clock: when each job started (a job not started yet: never)
    started = {job: float(r.hget(job_key(job), "started") or "inf") for job in admitted}
    mine_started = float(r.hget(job_key(mine["job_id"]), "started"))
    # the greedy address's first job ran before; its second and third start after the second visitor's
    assert len(admitted) >= 2 and sum(t < mine_started for t in started.values()) == 1, (
        started,
        mine_started,
    )
    for task in askers:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for socket in [*greedy, other]:
        await socket.ws.close()
    r.close()
