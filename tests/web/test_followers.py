"""Many pages following queued jobs on a live daphne: they wait on Redis (a blocking read of their job's
events and the queue's ticks) instead of polling it, so the site stays quick for everyone else."""

from __future__ import annotations

import asyncio
import statistics
import time
import urllib.request

import pytest
import redis

from common.protocol import JobClient, JobSpec, connect
from tests.support.sockets import PageSocket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "standin:50"
FOLLOWERS = 200
ADDRESSES = [f"127.0.0.{10 + i}" for i in range(25)]  # 8 pages each: the cap per address


def polls(r: redis.Redis) -> dict[str, int]:
    """How many times Redis has run the commands a follower of a queued job waits and looks with."""
    stats = r.info("commandstats")
    return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("xread", "hgetall", "lpos")}


def healthz_ms(url: str, seconds: float) -> list[float]:
    """Milliseconds of each GET /healthz, ten a second for `seconds`, from another address than the followers'."""
    took, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.perf_counter()
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as reply:
            assert reply.status == 200
        took.append((time.perf_counter() - started) * 1000)
        time.sleep(0.1)
    return took


async def test_200_pages_resuming_queued_jobs_leave_redis_and_the_site_quiet(
    start_worker, start_web, redis_url
):
    start_worker([MODEL])
    web = start_web({"PLAYGROUND_MAX_QUEUE": "0", "PLAYGROUND_MAX_SOCKETS_PER_IP": "8"})
    client = JobClient(connect(redis_url, use_asyncio=True), max_queue=0)
    busy = await client.submit(JobSpec(model=MODEL, prompt="b", params={"max_new_tokens": 100_000}))
    # queued jobs whose pages reloaded: a lease each, with the grace a page gets to come back
    queued = [
        await client.submit(JobSpec(model=MODEL, prompt=f"q{i}"), follower=f"gone-{i}", grace_s=120)
        for i in range(FOLLOWERS)
    ]
    pages = []
    try:
        for i, job_id in enumerate(queued):
            page = await PageSocket.open(web.url, ADDRESSES[i % len(ADDRESSES)])
            await page.send(type="resume", job_id=job_id, after="0-0")
            pages.append(page)
        positions = await asyncio.gather(*(p.until(("queue", "error"), timeout_s=60) for p in pages))
        assert {f["type"] for f in positions} == {"queue"}, [f for f in positions if f["type"] != "queue"][:3]
        assert sorted(f["position"] for f in positions) == list(range(FOLLOWERS))

        # While the 200 wait, each reads its job's events and looks at its job and place now and then (not
        # every 250 ms: ~4 reads, 4 looks and 4 places a second each); its lease's renewal aside
        sync = redis.Redis.from_url(redis_url)
        before, started = polls(sync), time.monotonic()
        assert all(before.values())  # counted: each follower has read and looked at least once
        took = await asyncio.to_thread(healthz_ms, web.url, 12)  # three times a follower's wait
        seconds = time.monotonic() - started
        per_follower_s = {name: (polls(sync)[name] - before[name]) / seconds / FOLLOWERS for name in before}
        p95 = statistics.quantiles(took, n=20)[-1]
        print(f"\nRedis commands a second per follower: {per_follower_s}; /healthz p95 {p95:.1f} ms")
        assert all(rate < 1 for rate in per_follower_s.values()), per_follower_s
        assert p95 < 100, sorted(took)
        sync.close()
    finally:
        for page in pages:
            await page.ws.close()
        await client.cancel(busy)
        await client.r.aclose()
