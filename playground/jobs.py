"""The web process's side of the job queue: a JobClient per event loop, the live workers in a form
the page shows, and the page's request turned into a JobSpec (validated once, here)."""

from __future__ import annotations

import asyncio
import weakref

import redis.asyncio as aioredis
from django.conf import settings

from inference.events import InvalidRequest, SamplingParams
from inference.protocol import JobClient, JobSpec

# redis.asyncio connections belong to the loop that opened them: daphne runs one loop, the tests
# one per test, so the client is cached per loop (and per URL, which tests change).
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# The page's field names -> SamplingParams fields.
PARAM_FIELDS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
}


def job_client() -> JobClient:
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    url = settings.REDIS_URL
    if url not in per_loop:
        # No socket_timeout: redis-py then wraps every send in asyncio.wait_for, which on Python 3.11
        # can swallow a task cancellation (CPython gh-86296) and so keep a worker busy for a gone client.
        r = aioredis.Redis.from_url(url, decode_responses=True, health_check_interval=30, socket_timeout=None)
        per_loop[url] = JobClient(r, max_queue=settings.PLAYGROUND_MAX_QUEUE)
    return per_loop[url]


def served_models(workers: list[dict]) -> dict[str, dict]:
    """Model name -> {chat, max_context, workers}: what the live workers serve, then the configured
    models (MODELS) that no live worker serves yet (they queue until one starts)."""
    models: dict[str, dict] = {}
    for worker in workers:
        info = worker.get("model_info", {})
        for name in worker.get("models", []):
            entry = models.setdefault(name, {"chat": False, "max_context": None, "workers": 0})
            entry.update({k: v for k, v in info.get(name, {}).items() if k in ("chat", "max_context")})
            entry["workers"] += 1
    for name in settings.PLAYGROUND_MODELS:
        models.setdefault(name, {"chat": False, "max_context": None, "workers": 0})
    return models


def worker_summary(workers: list[dict]) -> dict:
    """What the page's status pill and model picker show; compared between polls to send changes only."""
    models = served_models(workers)
    return {
        "up": bool(workers),
        "count": len(workers),
        "busy": sum(1 for w in workers if w.get("job")),
        "devices": sorted({str(w.get("device", "?")) for w in workers}),
        "models": [{"name": name, **info} for name, info in models.items()],
    }


def spec_from_frame(frame: dict, models: dict[str, dict]) -> JobSpec:
    """A `generate` frame -> JobSpec. Raises InvalidRequest naming the page's field."""
    prompt = frame.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("prompt", "must be a non-empty string")
    if len(prompt) > settings.PLAYGROUND_MAX_PROMPT_CHARS:
        raise InvalidRequest("prompt", f"must be at most {settings.PLAYGROUND_MAX_PROMPT_CHARS} characters")
    system = frame.get("system_prompt") or ""
    if not isinstance(system, str):
        raise InvalidRequest("system_prompt", "must be a string")

    model = frame.get("model") or next(iter(models), None)
    if model is None:
        raise InvalidRequest(
            "model", "no worker is up and MODELS is unset: start `python -m inference.worker`"
        )
    if not isinstance(model, str) or model not in models:
        raise InvalidRequest("model", f"unknown model {model!r}; available: {', '.join(models) or 'none'}")

    params = {field: frame[name] for name, field in PARAM_FIELDS.items() if frame.get(name) is not None}
    try:
        SamplingParams(**params)
    except InvalidRequest as exc:
        page_name = {field: name for name, field in PARAM_FIELDS.items()}.get(exc.field, exc.field)
        raise InvalidRequest(page_name, exc.message) from None
    cap = settings.PLAYGROUND_MAX_NEW_TOKENS
    if params.get("max_new_tokens", 0) > cap:
        raise InvalidRequest("max_tokens", f"must be <= {cap}, got {params['max_new_tokens']}")

    if models[model].get("chat"):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return JobSpec(model=model, messages=messages, chat=True, params=params, source="web")
    # A completion model has no roles: the system prompt is simply the start of the text.
    text = f"{system}\n\n{prompt}" if system else prompt
    return JobSpec(model=model, prompt=text, params=params, source="web")
