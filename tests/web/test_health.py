"""/healthz and /readyz (playground/health.py) against the suite's Redis and real worker processes."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
from django.test import AsyncClient, AsyncRequestFactory

from common.protocol import JobSpec, WorkerChannel, job_key, queue_key
from common.redis_server import free_port
from playground import health, jobs

pytestmark = pytest.mark.timeout(60)
MODEL = "standin:2000"


@pytest.fixture(autouse=True)
async def web_settings(settings, redis_url):
    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_MODELS = []
    yield settings
    await jobs.job_client().r.aclose()


async def get(view) -> tuple[int, dict]:
    response = await view(AsyncRequestFactory().get("/"))
    return response.status_code, json.loads(response.content)


async def test_healthz_answers_without_redis_or_workers(settings, caplog):
    port = free_port()
    settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"  # nothing listens there
    assert await get(health.healthz) == (200, {"ok": True})
    status, body = await get(health.readyz)
    assert status == 503 and body["redis"] is False
    # the public answer names no host or port; the log keeps Redis's own message for the operator
    assert body["reason"] == "the job queue is unreachable (ConnectionError)"
    assert str(port) in caplog.text and "unreachable" in caplog.text


async def test_not_ready_without_a_worker_ready_with_one_that_generates(start_worker):
    status, body = await get(health.readyz)
    assert status == 503 and body["reason"] == "no worker is up"
    start_worker([MODEL])
    body = await health.readiness(cache_s=0)
    assert body["ready"] and body["models"][MODEL]["detail"] == "generated" and body["workers"] == 1


async def test_a_configured_model_without_a_worker_is_not_ready(settings, start_worker):
    settings.PLAYGROUND_MODELS = [MODEL, "missing-model"]
    start_worker([MODEL])
    body = await health.readiness(cache_s=0)
    assert not body["ready"] and body["reason"] == "missing-model: no worker serves it"
    assert body["models"][MODEL]["ok"]


async def test_a_burst_of_probes_runs_one_generation_and_shares_the_result(start_worker, redis_url):
    start_worker([MODEL])
    results = await asyncio.gather(*(health.readiness(cache_s=5) for _ in range(20)))
    assert all(r["ready"] for r in results)
    assert len({r["checked_at"] for r in results}) == 1
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert len(r.keys(job_key("*"))) == 1  # one probe job for twenty probes
    r.close()


async def test_a_wedged_worker_that_still_heartbeats_fails_the_probe_and_the_probe_leaves_the_queue(
    redis_url,
):
    # A heartbeat with nobody taking jobs: what a worker stuck outside a job looks like from outside.
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    WorkerChannel(r, "wedged", ["m"]).heartbeat({"job": None})
    body = await health.readiness(cache_s=0, timeout_s=0.5)
    assert not body["ready"] and "did not finish within 0.5 s" in body["models"]["m"]["detail"]
    assert r.llen(queue_key("m")) == 0  # the probe does not wait there for a worker that comes back
    r.close()


async def test_a_model_whose_workers_are_all_busy_is_ready_without_a_probe(start_worker, redis_url):
    start_worker(["standin:20"])
    client = jobs.job_client()
    await client.submit(JobSpec(model="standin:20", prompt="busy", params={"max_new_tokens": 60}))  # 3 s
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    for _ in range(50):  # the heartbeat shows the job within a second
        beats = await client.workers()
        if beats and beats[0].get("job"):
            break
        await asyncio.sleep(0.1)
    body = await health.readiness(cache_s=0)
    assert body["ready"] and body["models"]["standin:20"]["detail"] == "busy"
    assert len(r.keys(job_key("*"))) == 1  # no probe went behind the long job
    r.close()


async def test_health_is_the_conventional_probe_without_a_generation(settings, start_worker, redis_url, rf):
    settings.PLAYGROUND_MODELS = [MODEL, "missing-model"]
    start_worker([MODEL])
    missing = await health.health(rf.get("/health"))
    assert missing.status_code == 503
    assert json.loads(missing.content) == {
        "status": "unavailable",
        "reason": "no worker serves missing-model",
        "models": {MODEL: 1, "missing-model": 0},
    }
    settings.PLAYGROUND_MODELS = [MODEL]
    ok = await health.health(rf.get("/health"))
    assert ok.status_code == 200 and json.loads(ok.content) == {"status": "ok", "models": {MODEL: 1}}
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.keys(job_key("*")) == []  # it asked nothing of the worker
    r.close()


@pytest.mark.parametrize("path", ["/healthz", "/health", "/readyz", "/metrics"])
async def test_a_probe_refuses_other_methods_with_a_json_405_not_the_csrf_page(path):
    response = await AsyncClient(enforce_csrf_checks=True).post(
        path, {"a": 1}, content_type="application/json"
    )
    assert response.status_code == 405 and response["Allow"] == "GET, HEAD"
    assert json.loads(response.content) == {"error": "POST is not allowed here; use GET"}
