"""Probes for a load balancer or an orchestrator.

/healthz  the process is alive: answers without touching Redis, the database or a worker.
/health   llama.cpp's and vLLM's probe path: 200 {"status": "ok"} while Redis answers and every configured
          model (with none configured: some model) has a live worker, else 503 with the reason; no generation.
/readyz   the whole path works: Redis answers, every configured model has a live worker, and a
          one-token generation goes through the queue and back within PLAYGROUND_READY_TIMEOUT_S.

A probe generation takes a worker for a moment, so a result is kept for PLAYGROUND_READY_CACHE_S
(shared through Redis by every web process) and concurrent probes of one process wait for the
same check: however often the orchestrator asks, the GPU sees at most one probe per interval.
A model whose every worker is busy is not probed: a worker that is generating is, by the stall
watchdog's guarantee, making progress, and a probe would only measure the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import weakref

import redis
from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from common.protocol import PREFIX, JobSpec, QueueFull
from playground.jobs import job_client

CACHE_KEY = f"{PREFIX}web:readyz"
PROBE_PROMPT = "def"

_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per event loop
log = logging.getLogger(__name__)


def queue_unreachable(exc: redis.RedisError) -> str:
    """The probe's reason, in the log with Redis's own message (it names the host and port), and public
    without it: /readyz answers anyone who can reach the site."""
    log.warning("readyz: the job queue is unreachable: %s", exc)
    return f"the job queue is unreachable ({type(exc).__name__})"


def probe(view):
    """A read-only probe: GET and HEAD, and any other method a JSON 405 (not the CSRF check's HTML page)."""

    @csrf_exempt
    @functools.wraps(view)
    async def wrapped(request, *args, **kwargs):
        if request.method not in ("GET", "HEAD"):
            response = JsonResponse({"error": f"{request.method} is not allowed here; use GET"}, status=405)
            response["Allow"] = "GET, HEAD"
            return response
        response = await view(request, *args, **kwargs)
        if (
            response.status_code >= 500
        ):  # an expected answer (a model loading, Redis away): one line, not an ERROR
            log.warning(
                "%s answered %d: %s", request.path, response.status_code, response.content[:200].decode()
            )
            response._has_been_logged = True  # read by django.utils.log.log_response
        return response

    return wrapped


@probe
async def healthz(request):
    return JsonResponse({"ok": True})


@probe
async def health(request):
    try:
        workers = await job_client().workers()
    except redis.RedisError as exc:
        return JsonResponse({"status": "unavailable", "reason": queue_unreachable(exc)}, status=503)
    served: dict[str, int] = {}
    for worker in workers:
        for model in worker.get("models", []):
            served[model] = served.get(model, 0) + 1
    models = {model: served.get(model, 0) for model in settings.PLAYGROUND_MODELS} or served
    missing = [model for model, count in models.items() if not count]
    if not models or missing:
        reason = f"no worker serves {', '.join(missing)}" if missing else "no worker is up"
        return JsonResponse({"status": "unavailable", "reason": reason, "models": models}, status=503)
    return JsonResponse({"status": "ok", "models": models})


@probe
async def readyz(request):
    result = await readiness()
    return JsonResponse(result, status=200 if result["ready"] else 503)


async def readiness(cache_s: float | None = None, timeout_s: float | None = None) -> dict:
    cache_s = settings.PLAYGROUND_READY_CACHE_S if cache_s is None else cache_s
    jobs = job_client()
    lock = _locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock:  # a burst of probes shares one check
        try:
            cached = await jobs.r.get(CACHE_KEY) if cache_s > 0 else None
        except redis.RedisError as exc:
            return {"ready": False, "redis": False, "reason": queue_unreachable(exc)}
        if cached:
            return json.loads(cached)
        result = await check(jobs, settings.PLAYGROUND_READY_TIMEOUT_S if timeout_s is None else timeout_s)
        if cache_s > 0:
            with contextlib.suppress(redis.RedisError):  # uncached, the next probe checks again
                await jobs.r.set(CACHE_KEY, json.dumps(result), px=int(cache_s * 1000))
        return result


async def check(jobs, timeout_s: float) -> dict:
    result = {"ready": False, "redis": True, "checked_at": time.time(), "models": {}}
    try:
        workers = await jobs.workers()
    except redis.RedisError as exc:
        return {**result, "redis": False, "reason": queue_unreachable(exc)}
    result["workers"] = len(workers)
    models = list(settings.PLAYGROUND_MODELS) or sorted({m for w in workers for m in w.get("models", [])})
    if not models:
        return {**result, "reason": "no worker is up"}
    probes = [probe_model(jobs, model, workers, timeout_s) for model in models]
    result["models"] = dict(zip(models, await asyncio.gather(*probes), strict=True))
    failed = [f"{model}: {state['detail']}" for model, state in result["models"].items() if not state["ok"]]
    result["ready"] = not failed
    if failed:
        result["reason"] = "; ".join(failed)
    return result


async def probe_model(jobs, model: str, workers: list[dict], timeout_s: float) -> dict:
    serving = [w for w in workers if model in w.get("models", [])]
    if not serving:
        return {"ok": False, "workers": 0, "detail": "no worker serves it"}
    state = {"workers": len(serving)}
    if all(w.get("job") for w in serving):
        return {**state, "ok": True, "detail": "busy"}
    # A worker is idle, so its queue is empty: the probe goes straight through and delays nobody.
    spec = JobSpec(model=model, prompt=PROBE_PROMPT, params={"max_new_tokens": 1}, source="probe")
    started = time.monotonic()
    try:
        await jobs.submit(spec)
    except QueueFull:
        return {**state, "ok": True, "detail": "busy"}
    try:
        async with asyncio.timeout(timeout_s):
            kind, data = await jobs.outcome(spec.id, block_ms=100)
    except TimeoutError:
        await jobs.cancel(spec.id)
        return {**state, "ok": False, "detail": f"a one-token probe did not finish within {timeout_s:g} s"}
    ms = round((time.monotonic() - started) * 1000, 1)
    if kind == "error":
        return {**state, "ok": False, "detail": f"probe failed: {data.get('code')}: {data.get('message')}"}
    return {**state, "ok": True, "detail": "generated", "probe_ms": ms}
