"""Prometheus metrics at /metrics, in a registry of our own (nothing else registers into it).

What the queue holds and what the workers do is read from Redis when Prometheus scrapes, so
every web process reports the same truth however many there are. What happened to jobs (time
to first token, decode speed, errors, rate-limit refusals) is counted where it is seen: each
finished job once, by whichever web process sees its end first (a flag in Redis).

    PLAYGROUND_METRICS_TOKEN   when set, /metrics wants `Authorization: Bearer <token>`
"""

from __future__ import annotations

import hmac
import logging
import os

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpResponse, JsonResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from common.protocol import EVENTS_TTL_S, PREFIX, JobClient, queue_key
from playground.health import probe
from playground.jobs import job_client
from playground.store import database_bytes
from playground.supervise import RESTARTS_KEY

disable_created_metrics()  # a counter's *_created series is a gauge of its own nobody graphs

REGISTRY = CollectorRegistry()
log = logging.getLogger(__name__)

QUEUE_DEPTH = Gauge("kog_queue_depth", "Jobs waiting for a worker, per model", ["model"], registry=REGISTRY)
WORKERS = Gauge("kog_workers", "Workers with a live heartbeat", registry=REGISTRY)
RUNNING_JOBS = Gauge("kog_running_jobs", "Jobs being generated right now", registry=REGISTRY)
REDIS_UP = Gauge("kog_redis_up", "1 when the job queue answered the scrape", registry=REGISTRY)
DATABASE_BYTES = Gauge(
    "kog_database_bytes", "The database's size on disk (saved generations)", registry=REGISTRY
)
RESTARTS = Gauge(
    "kog_process_restarts",
    "Restarts of a process `make run` supervises (worker, daphne, redis) since its launch",
    ["process"],
    registry=REGISTRY,
)

TTFT = Histogram(
    "kog_time_to_first_token_seconds",
    "From the worker starting a job to its first token (prefill included)",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
DECODE_SPEED = Histogram(
    "kog_decode_tokens_per_second",
    "Decode speed of each finished job, (n - 1) / (t_last - t_first)",
    ["model"],
    buckets=(10, 25, 50, 100, 200, 300, 400, 500, 750, 1000, 1500, 2000, 3000, 5000),
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "kog_queue_wait_seconds",
    "From submission to a worker taking the job",
    ["model"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
JOBS = Counter(
    "kog_jobs_total", "Finished jobs by how they ended", ["model", "source", "outcome"], registry=REGISTRY
)
GENERATED_TOKENS = Counter("kog_generated_tokens_total", "Tokens generated", ["model"], registry=REGISTRY)
PROMPT_TOKENS = Counter(
    "kog_prompt_tokens_total", "Prompt tokens of finished jobs", ["model"], registry=REGISTRY
)
CACHED_PROMPT_TOKENS = Counter(
    "kog_prompt_cached_tokens_total",
    "Prompt tokens whose KV a worker reused from an earlier request (not prefilled again)",
    ["model"],
    registry=REGISTRY,
)
ERRORS = Counter("kog_errors_total", "Errors sent to clients, by kind", ["kind"], registry=REGISTRY)
RATE_LIMITED = Counter(
    "kog_rate_limited_total", "Requests refused by a rate limit", ["limit"], registry=REGISTRY
)

# Error codes become label values: an unexpected one is counted as "other" so that no client input
# can grow the number of time series.
ERROR_KINDS = frozenset(
    {
        *("bad_frame", "frame_too_large", "invalid_request", "invalid_json", "body_too_large", "busy"),
        *("queue_full", "rate_limited", "unauthorized", "unknown_job", "cancelled", "no_workers"),
        *("worker_lost", "stalled", "out_of_memory", "internal_error", "unavailable", "queue_restarted"),
        *("rate_limit_exceeded", "invalid_value", "model_not_found", "invalid_api_key", "unknown_url"),
        *("queue_down", "method_not_allowed", "context_length_exceeded", "unsupported_media_type"),
        *("too_many_jobs", "too_many_sockets"),
    }
)


def count_error(kind: str | None) -> None:
    ERRORS.labels(kind=kind if kind in ERROR_KINDS else "other").inc()


async def observe_finished(
    r, job_id: str, model: str, source: str, kind: str, data: dict, queue_ms: float | None
):
    """Record a job's terminal event, once per job whichever process or socket sees it."""
    if source == "probe" or not await r.set(f"{PREFIX}observed:{job_id}", 1, nx=True, ex=EVENTS_TTL_S):
        return
    if kind == "error":
        JOBS.labels(model, source, "error").inc()
        count_error(data.get("code"))
        return
    JOBS.labels(model, source, data.get("finish_reason") or "done").inc()
    stats = data.get("stats")
    if not stats:  # cancelled before it started
        return
    GENERATED_TOKENS.labels(model).inc(stats.get("completion_tokens", 0))
    PROMPT_TOKENS.labels(model).inc(stats.get("prompt_tokens", 0))
    CACHED_PROMPT_TOKENS.labels(model).inc(stats.get("cached_tokens", 0))
    try:  # what the workers produce: the page's estimated waits, the per-address token budget
        await JobClient(r).record_speed(model, stats)
    except redis.RedisError as exc:  # the job is counted; its speed misses one sample
        log.warning("could not record the speed of %s: %s", job_id, exc)
    if stats.get("completion_tokens"):
        TTFT.labels(model).observe(stats["ttft_ms"] / 1000)
    if stats.get("decode_tok_s"):
        DECODE_SPEED.labels(model).observe(stats["decode_tok_s"])
    if queue_ms is not None:
        QUEUE_WAIT.labels(model).observe(queue_ms / 1000)


async def refresh_from_redis(jobs, models: list[str]) -> None:
    """Set the gauges that describe the shared queue: depth per model, workers, running jobs."""
    try:
        workers = await jobs.workers()
        names = sorted({*models, *(m for w in workers for m in w.get("models", []))})
        pipe = jobs.r.pipeline(transaction=False)
        for name in names:
            pipe.llen(queue_key(name))
        pipe.hgetall(RESTARTS_KEY)
        *depths, restarts = await pipe.execute()
    except redis.RedisError:
        REDIS_UP.set(0)
        return
    REDIS_UP.set(1)
    WORKERS.set(len(workers))
    RUNNING_JOBS.set(sum(1 for w in workers if w.get("job")))
    QUEUE_DEPTH.clear()  # a model no longer served or configured stops being reported
    for name, depth in zip(names, depths, strict=True):
        QUEUE_DEPTH.labels(name).set(depth)
    RESTARTS.clear()  # only under make run's launcher, which writes them (playground/supervise.py)
    for process, count in restarts.items():
        RESTARTS.labels(process).set(int(count))


async def refresh_database_size() -> None:
    try:
        size = await sync_to_async(database_bytes, thread_sensitive=False)()
    except Exception as exc:  # noqa: BLE001 - a scrape still answers with what it has
        log.warning("could not read the database's size: %s", exc)
        return
    if size is not None:
        DATABASE_BYTES.set(size)


@probe
async def metrics_view(request):
    token = os.environ.get("PLAYGROUND_METRICS_TOKEN", "")
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return JsonResponse(
                {"error": "metrics need `Authorization: Bearer <PLAYGROUND_METRICS_TOKEN>`"}, status=401
            )
    await refresh_from_redis(job_client(), settings.PLAYGROUND_MODELS)
    await refresh_database_size()
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
