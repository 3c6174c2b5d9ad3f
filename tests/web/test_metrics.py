"""Prometheus metrics (playground/metrics.py): the scrape reads the shared queue from Redis, job outcomes
are counted once per job, and label values cannot be grown by clients."""

from __future__ import annotations

import pytest
import redis
from django.test import AsyncRequestFactory
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import JobSpec, WorkerChannel, queue_key
from common.redis_server import free_port
from playground import jobs, metrics


@pytest.fixture(autouse=True)
async def web_settings(settings, redis_url):
    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_MODELS = ["configured-model"]
    yield settings
    await jobs.job_client().r.aclose()


async def scrape(headers: dict | None = None) -> tuple[int, dict]:
    """Status and {(name, frozenset(labels)): value} of one GET /metrics."""
    response = await metrics.metrics_view(AsyncRequestFactory().get("/metrics", headers=headers or {}))
    if response.status_code != 200:
        return response.status_code, {}
    assert response["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return 200, samples


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def test_the_scrape_reads_queue_depth_workers_and_running_jobs_from_redis(redis_url):
    client = jobs.job_client()
    for i in range(3):
        await client.submit(JobSpec(model="configured-model", prompt=f"p{i}"))
    status, samples = await scrape()
    assert status == 200
    assert value(samples, "kog_queue_depth", model="configured-model") == 3
    assert value(samples, "kog_workers") == 0 and value(samples, "kog_running_jobs") == 0
    assert value(samples, "kog_redis_up") == 1

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    WorkerChannel(r, "w-busy", ["served-model"]).heartbeat({"job": "some-job"})
    WorkerChannel(r, "w-idle", ["served-model"]).heartbeat({"job": None})
    r.close()
    await client.r.lpop(queue_key("configured-model"))
    _, samples = await scrape()
    assert value(samples, "kog_queue_depth", model="configured-model") == 2
    assert value(samples, "kog_queue_depth", model="served-model") == 0  # a served model is listed too
    assert value(samples, "kog_workers") == 2 and value(samples, "kog_running_jobs") == 1
    metrics.count_error("queue_down")  # a counter with a child: the client would add its *_created gauge
    _, samples = await scrape()
    assert not [name for name, _ in samples if name.endswith("_created")]


async def test_a_scrape_with_redis_down_still_answers_and_says_so(settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    status, samples = await scrape()
    assert status == 200 and value(samples, "kog_redis_up") == 0


async def test_a_finished_job_is_counted_once_whoever_sees_it():
    r = jobs.job_client().r
    done = {
        "finish_reason": "length",
        "text": "x" * 40,
        "stats": {"completion_tokens": 40, "ttft_ms": 120.0, "decode_tok_s": 480.0},
    }
    before = metrics.REGISTRY.get_sample_value("kog_generated_tokens_total", {"model": "m1"}) or 0
    ttft_count = (
        metrics.REGISTRY.get_sample_value("kog_time_to_first_token_seconds_count", {"model": "m1"}) or 0
    )
    for _ in range(3):  # the first socket, a resumed one, the API: the same job seen three times
        await metrics.observe_finished(r, "job-a", "m1", "web", "done", done, queue_ms=250.0)
    assert metrics.REGISTRY.get_sample_value("kog_generated_tokens_total", {"model": "m1"}) == before + 40
    assert metrics.REGISTRY.get_sample_value("kog_time_to_first_token_seconds_count", {"model": "m1"}) == (
        ttft_count + 1
    )
    # 0.12 s falls in the 0.25 s bucket, 480 tok/s in the 500 one
    assert metrics.REGISTRY.get_sample_value(
        "kog_time_to_first_token_seconds_bucket", {"model": "m1", "le": "0.25"}
    ) >= 1 + (
        metrics.REGISTRY.get_sample_value(
            "kog_time_to_first_token_seconds_bucket", {"model": "m1", "le": "0.1"}
        )
        or 0
    )
    assert (
        metrics.REGISTRY.get_sample_value(
            "kog_decode_tokens_per_second_bucket", {"model": "m1", "le": "500.0"}
        )
        >= 1
    )
    assert (
        metrics.REGISTRY.get_sample_value(
            "kog_jobs_total", {"model": "m1", "source": "web", "outcome": "length"}
        )
        >= 1
    )


async def test_errors_are_counted_by_kind_and_unknown_kinds_cannot_add_series():
    r = jobs.job_client().r
    lost = metrics.REGISTRY.get_sample_value("kog_errors_total", {"kind": "worker_lost"}) or 0
    await metrics.observe_finished(r, "job-b", "m1", "api", "error", {"code": "worker_lost"}, None)
    assert metrics.REGISTRY.get_sample_value("kog_errors_total", {"kind": "worker_lost"}) == lost + 1
    other = metrics.REGISTRY.get_sample_value("kog_errors_total", {"kind": "other"}) or 0
    for i in range(5):
        metrics.count_error(f"attacker-chosen-{i}")
    assert metrics.REGISTRY.get_sample_value("kog_errors_total", {"kind": "other"}) == other + 5
    _, samples = await scrape()
    assert not [key for key in samples if key[0] == "kog_errors_total" and "attacker" in str(key[1])]


async def test_probe_jobs_are_not_counted():
    r = jobs.job_client().r
    done = {"finish_reason": "length", "text": "x", "stats": {"completion_tokens": 1, "ttft_ms": 5.0}}
    await metrics.observe_finished(r, "probe-1", "probe-model", "probe", "done", done, None)
    assert metrics.REGISTRY.get_sample_value("kog_generated_tokens_total", {"model": "probe-model"}) is None


async def test_a_metrics_token_keeps_strangers_out(monkeypatch):
    monkeypatch.setenv("PLAYGROUND_METRICS_TOKEN", "s3cret")
    assert (await scrape())[0] == 401
    assert (await scrape({"Authorization": "Bearer wrong"}))[0] == 401
    assert (await scrape({"Authorization": "Bearer s3cret"}))[0] == 200


async def test_prompt_tokens_and_those_a_worker_reused_are_counted():
    r = jobs.job_client().r
    done = {
        "finish_reason": "stop",
        "text": "ok",
        "stats": {"prompt_tokens": 1840, "cached_tokens": 1796, "completion_tokens": 2, "ttft_ms": 9.0},
    }
    sample = metrics.REGISTRY.get_sample_value
    before = sample("kog_prompt_cached_tokens_total", {"model": "m-prefix"}) or 0
    prompt_before = sample("kog_prompt_tokens_total", {"model": "m-prefix"}) or 0
    for _ in range(2):  # seen twice, counted once
        await metrics.observe_finished(r, "job-prefix", "m-prefix", "api", "done", done, queue_ms=None)
    assert sample("kog_prompt_cached_tokens_total", {"model": "m-prefix"}) == before + 1796
    assert sample("kog_prompt_tokens_total", {"model": "m-prefix"}) == prompt_before + 1840


@pytest.mark.django_db(transaction=True)
async def test_the_scrape_gives_the_databases_size_and_it_grows_with_saved_runs():
    from playground.store import save_generation

    _, before = await scrape()
    assert value(before, "kog_database_bytes") > 0
    done = {"finish_reason": "stop", "text": "o" * 200_000, "stats": {"completion_tokens": 1}}
    await save_generation(JobSpec(model="m", prompt="p"), done)
    _, after = await scrape()
    assert value(after, "kog_database_bytes") > value(before, "kog_database_bytes")
