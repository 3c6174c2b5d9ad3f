"""The OpenAI-compatible API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Async views in daphne's event loop: an open stream is a coroutine reading its job's Redis stream,
never a thread. Jobs take the same queue and workers as the page. Every error before the first byte
is an OpenAI-shaped JSON body with its HTTP status; a failure mid-stream is an error chunk, then
`data: [DONE]`. A client that goes away cancels its job: Django cancels the view (or closes the
stream's generator) on http.disconnect, and the cleanup below tells the worker to stop. A request holds
a lease on its job while it streams or waits for it (playground.jobs.Lease): if the web process dies,
SIGKILL included, the lease lapses and the job's worker cancels it within seconds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from redis.exceptions import RedisError

from common.events import InvalidRequest
from common.protocol import TERMINAL, JobSpec, QueueFull, VisitorBusy
from playground import metrics
from playground.api.auth import authenticate
from playground.api.errors import ApiError, body_too_large
from playground.api.params import ApiRequest, json_depth, parse_request
from playground.jobs import Lease, job_client, redis_back, served_models
from playground.limits import configured as limit_config
from playground.limits import ip_from_request, limiter, visitor
from playground.store import save_generation

log = logging.getLogger("playground.api")
INTERNAL_ERROR = "Internal server error (the details are in the server's log)"
STREAM_START_GRACE_S = 5.0
MAX_BODY_DEPTH = 32  # levels of [ and { in a request body
_background: set[asyncio.Task] = set()


def endpoint(*methods: str):
    """An API view: CSRF-exempt (bearer keys, not cookies), method and key checked, ApiError -> JSON, and
    every answer, refusals included, named by its `x-request-id` (a job's id when it makes one)."""
    if "GET" in methods:  # HTTP asks every GET resource to answer HEAD too; the server drops the body
        methods = (*methods, "HEAD")

    def decorate(view):
        @csrf_exempt
        @functools.wraps(view)
        async def wrapped(request, *args, **kwargs):
            request.request_id = uuid.uuid4().hex
            response = await answer(request, *args, **kwargs)
            response["x-request-id"] = request.request_id
            if response.status_code >= 400:
                # One line of ours, naming the refusal's code and the request, instead of Django's generic
                # "Service Unavailable: /v1/..." (an ERROR for every 5xx, though a 503 is an expected answer
                # while no worker is up or the queue is away; a bug's 500 was logged above, with its traceback).
                code = getattr(response, "error_code", None)
                log.warning("api: %s %s answered %d %s (request %s)", request.method, request.path,
                            response.status_code, code, request.request_id)  # fmt: skip
                response._has_been_logged = True  # read by django.utils.log.log_response
            return response

        async def answer(request, *args, **kwargs):
            try:
                if request.method not in methods:
                    error = ApiError(405, f"{request.method} is not allowed here; use {', '.join(methods)}")
                    response = error.response()
                    response["Allow"] = ", ".join(methods)
                    return response
                request.api_key = await authenticate(request)
                return await view(request, *args, **kwargs)
            except ApiError as error:
                if not error.counted:
                    metrics.count_error(error.body["error"]["code"])
                return error.response()
            except RedisError as exc:
                log.warning("api: the job queue is unreachable: %s", exc)
                return ApiError(
                    503, "The job queue is unavailable", "server_error", code="queue_down"
                ).response()
            except Exception:  # an API client wants JSON, never Django's HTML error page
                log.exception(
                    "api: %s %s failed (request %s)", request.method, request.path, request.request_id
                )
                return ApiError(500, INTERNAL_ERROR, "server_error").response()

        return wrapped

    return decorate


async def known_models() -> dict[str, dict]:
    """id -> its /v1/models entry: what the live workers serve, then the configured MODELS."""
    return model_entries(served_models(await job_client().workers()))


def model_entries(models: dict[str, dict]) -> dict[str, dict]:
    """served_models' answer as /v1/models entries, by id."""
    return {
        name: {
            "id": name,
            "object": "model",
            "created": 0,  # unknown: models come and go with their workers
            "owned_by": "kog",
            "max_model_len": info["max_context"],  # vLLM's name for the context length
            "workers": info["workers"],
        }
        for name, info in sorted(models.items())
    }


@endpoint("GET")
async def models(request):
    return JsonResponse({"object": "list", "data": list((await known_models()).values())})


@endpoint("GET")
async def model_detail(request, model: str):
    card = (await known_models()).get(model)
    if card is None:
        raise ApiError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
    return JsonResponse(card)


@endpoint("GET", "POST", "PUT", "PATCH", "DELETE")
async def not_found(request, path: str = ""):
    raise ApiError(404, f"Unknown API route {request.path}", code="unknown_url")


@endpoint("POST")
async def completions(request):
    return await complete(request, chat=False)


@endpoint("POST")
async def chat_completions(request):
    return await complete(request, chat=True)


def json_body(request):
    """The request's body, parsed; ApiError (413, 415 or 400) says what is wrong with it."""
    try:
        raw = request.body
    except RequestDataTooBig:
        raise body_too_large() from None
    if raw and request.content_type != "application/json":
        # A page of another origin can make a browser POST a form (text/plain, urlencoded, multipart)
        # here without asking first; a JSON body makes the browser ask (a CORS preflight), which
        # playground/api/cors.py refuses unless the operator allows that origin.
        raise ApiError(
            415, "Send the body as JSON, with `Content-Type: application/json`", code="unsupported_media_type"
        )
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # json's decoder recurses once per [ or {: a bad body, not our bug
        raise ApiError(400, "The body is not valid JSON: nested too deeply", code="invalid_json") from None
    # No request field nests deeper; a body that does would only reach code that recurses (comparisons, the
    # job's JSON) with it.
    if json_depth(body) > MAX_BODY_DEPTH:
        raise ApiError(
            400, f"The body nests more than {MAX_BODY_DEPTH} levels deep", code="invalid_json"
        ) from None
    return body


async def complete(request, chat: bool):
    body = json_body(request)
    limits = settings.PLAYGROUND_MAX_NEW_TOKENS, settings.PLAYGROUND_MAX_PROMPT_CHARS
    try:
        # checked before the queue is asked anything: a bad request is a 400 at once, the queue up or down
        api_request = parse_request(body, chat, *limits, job_id=request.request_id)
        served = served_models(await job_client().workers())
        # the checkpoint's recommended sampling (its generation_config.json) for what the request left out,
        # as vLLM takes it
        defaults = served.get(api_request.spec.model, {}).get("sampling_defaults")
        if defaults:
            api_request = parse_request(
                body, chat, *limits, job_id=request.request_id, model_defaults=defaults
            )
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=exc.field, code="invalid_value") from None
    models = model_entries(served)
    spec = api_request.spec
    if spec.model not in models:
        message = f"The model {spec.model!r} does not exist; served: {', '.join(models) or 'none'}"
        # OpenAI's status for it (the client raises NotFoundError), as GET /v1/models/<id> answers
        raise ApiError(404, message, param="model", code="model_not_found")
    if not models[spec.model]["workers"]:
        raise ApiError(503, f"No worker serves {spec.model!r} right now", "server_error", code="no_workers")
    if spec.template_kwargs and not served[spec.model].get("template_kwargs"):
        # a worker from before chat_template_kwargs would drop them (JobSpec.from_json leaves unknown fields out)
        raise ApiError(400, "chat_template_kwargs: no worker of this model renders them yet; send the request "
                       "without them", param="chat_template_kwargs", code="invalid_value")  # fmt: skip
    # A key has its own budget; without one, the client's address has (see playground/limits.py).
    ip = ip_from_request(request, limit_config().trusted_proxies)
    key_id = str(request.api_key.pk) if request.api_key is not None else None
    verdict = await limiter().admit(ip, api_key=key_id)
    if not verdict.allowed:
        raise ApiError(429, verdict.message, type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(verdict.retry_after_s)})  # fmt: skip
    run = JobRun(spec, ip, key_id)
    try:
        await run.submit()
    except QueueFull as exc:
        await limiter().refund(verdict)  # turned away: a client that honours Retry-After is not charged
        # A queue drains as fast as its workers generate: a second is a fair first retry.
        raise ApiError(
            429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
        ) from None
    except VisitorBusy as exc:
        await limiter().refund(verdict)
        raise ApiError(
            429, str(exc), type="rate_limit_error", code="too_many_jobs", headers={"Retry-After": "2"}
        ) from None
    except Exception:  # never queued (the queue is down, a bug): the request does not count either
        await limiter().refund(verdict)
        raise

    try:
        # Wait for the job's first real event before any status line goes out, so that a refusal
        # from the worker (a prompt over the context) is still a plain 400, streaming or not.
        first = await run.next()
        if first[0] == "error":
            raise job_error(first[1], counted=True)
        if api_request.stream:
            response = StreamingHttpResponse(
                sse_stream(run, first, api_request), content_type="text/event-stream"
            )
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"  # nginx: pass each chunk on at once
            run.cancel_unless_streaming_within(STREAM_START_GRACE_S)
            return response
        event = first
        while event[0] not in TERMINAL:
            event = await run.next()
        if event[0] == "error":
            raise job_error(event[1], counted=True)
        return JsonResponse(await run.finish(event[1]))
    except BaseException:  # the client left (CancelledError) or we failed: stop the job
        await run.cancel_unless_finished()
        raise


def in_background(coroutine) -> None:
    task = asyncio.ensure_future(coroutine)
    _background.add(task)  # the loop keeps only a weak reference to a task
    task.add_done_callback(_background.discard)


async def save(spec: JobSpec, done: dict) -> None:
    """Keep the generation like the page's; a database hiccup must not fail the reply."""
    try:
        await save_generation(spec, done)
    except Exception:
        log.exception("could not save api generation %s", spec.id, extra={"job_id": spec.id})


class JobRun:
    """One submitted job's events without the queue chatter, and what the reply needs from them."""

    def __init__(self, spec: JobSpec, ip: str, key_id: str | None):
        self.spec = spec
        self.ip, self.key_id = ip, key_id  # whose budget the generated tokens are charged to
        self.jobs = job_client()
        self.lease = Lease(self.jobs, spec.id)
        self.after = "0-0"  # the last event read: where reading starts again after losing Redis
        # known: this request submitted the job, so one missing after a Redis restart was lost to it
        self.events = self.jobs.events(spec.id, known=True)
        self.queue_ms = 0.0
        self.finished = False
        self.streaming = False

    async def submit(self) -> None:
        """Queue the job with this request's lease on it (no grace: an API client does not come back)."""
        await self.jobs.submit(
            self.spec, follower=self.lease.follower, grace_s=0.0, visitor=visitor(self.ip, self.key_id)
        )
        self.lease.keep()

    async def next(self) -> tuple[str, dict]:
        lost_redis_at = None
        while True:
            try:
                entry_id, kind, data = await anext(self.events)
            except RedisError as exc:
                # Redis went away (it may be restarting): read on from the last event once it answers, as
                # the page does; a job that did not survive a restart is then reported by the protocol.
                if lost_redis_at is None:
                    lost_redis_at = asyncio.get_running_loop().time()
                    log.warning("api job %s: lost redis, waiting for it: %s", self.spec.id, exc,
                                extra={"job_id": self.spec.id})  # fmt: skip
                if await redis_back(self.jobs, lost_redis_at + settings.PLAYGROUND_REDIS_RETRY_S):
                    self.events = self.jobs.events(self.spec.id, after=self.after, known=True)
                    continue
                return self.queue_unreachable()
            lost_redis_at = None
            if entry_id:
                self.after = entry_id
            # On Python 3.11 asyncio.wait_for (redis-py wraps every send in it) can swallow a cancel
            # that lands as the send completes (CPython gh-86296, fixed in 3.12). The task still
            # counts the request, so honour it here: a client that left must not keep a worker busy.
            if asyncio.current_task().cancelling():
                raise asyncio.CancelledError
            if kind == "started":
                self.queue_ms = data["queue_ms"]
            elif kind != "queue":
                self.finished = kind in TERMINAL
                if self.finished:
                    self.lease.stop()
                    await self.account(kind, data)
                return kind, data

    def queue_unreachable(self) -> tuple[str, dict]:
        """The job's end when Redis stayed away past PLAYGROUND_REDIS_RETRY_S: a retryable error (503). Its
        worker, should it run on, stops the job once this request's lease has lapsed."""
        self.finished = True
        self.lease.stop()
        wait = settings.PLAYGROUND_REDIS_RETRY_S
        log.warning("api job %s: redis did not come back within %g s; giving up", self.spec.id, wait,
                    extra={"job_id": self.spec.id})  # fmt: skip
        metrics.count_error("queue_down")  # here: the job's end is not in Redis for account() to observe
        message = (
            f"The job queue was unreachable for {wait:g} s, so this generation is lost; please run it again"
        )
        return "error", {"code": "queue_down", "message": message}

    async def account(self, kind: str, data: dict) -> None:
        """Metrics and the token budget, once the job has ended; neither may fail the reply."""
        try:
            await metrics.observe_finished(
                self.jobs.r, self.spec.id, self.spec.model, "api", kind, data, self.queue_ms
            )
            if kind == "done" and data.get("stats"):
                tokens = data["stats"]["completion_tokens"]
                await limiter().charge_tokens(self.ip, self.key_id, tokens, self.spec.id)
        except RedisError as exc:
            log.warning(
                "could not account for api job %s: %s", self.spec.id, exc, extra={"job_id": self.spec.id}
            )

    async def cancel_unless_finished(self) -> None:
        if not self.finished:
            self.finished = True
            self.lease.stop()
            await self.jobs.cancel(self.spec.id)
            log.info(
                "api job %s cancelled: the client went away", self.spec.id, extra={"job_id": self.spec.id}
            )
            # what it generated until then counts too: a client that hangs up just before the end
            # must not have its answer outside its token budget
            in_background(self.account_when_ended())

    async def account_when_ended(self) -> None:
        try:
            await self.account(*await self.jobs.outcome(self.spec.id, known=True))
        except RedisError as exc:
            log.warning(
                "could not account for api job %s: %s", self.spec.id, exc, extra={"job_id": self.spec.id}
            )

    def cancel_unless_streaming_within(self, seconds: float) -> None:
        """A client that leaves after the view returned but before the first chunk never starts the
        stream's generator, so the generator's cleanup never runs: look once more a little later."""

        def check():
            if not self.streaming and not self.finished:
                in_background(self.cancel_unless_finished())

        asyncio.get_running_loop().call_later(seconds, check)

    async def finish(self, done: dict) -> dict:
        """The non-streamed body for a `done` event (a job cancelled elsewhere is an error)."""
        if done["finish_reason"] == "cancelled":
            raise job_error({"code": "cancelled", "message": "The job was cancelled before it finished"})
        await save(self.spec, done)
        body = reply_envelope(self.spec, "chat.completion" if self.spec.chat else "text_completion")
        if self.spec.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done["text"]}}
        else:
            choice = {"index": 0, "text": done["text"]}
        body["choices"] = [{**choice, "finish_reason": done["finish_reason"], "logprobs": None}]
        body["usage"] = usage(done["stats"])
        body["timings"] = timings(done["stats"], self.queue_ms)
        return body


async def sse_stream(run: JobRun, first: tuple[str, dict], api_request: ApiRequest):
    """`data: {chunk}` lines: the deltas, a last chunk with finish_reason and timings, then [DONE]."""
    run.streaming = True
    spec = run.spec
    chunk = Chunks(spec, api_request.include_usage)
    streamed = []
    try:
        if spec.chat:
            yield chunk.delta({"role": "assistant", "content": ""})
        kind, data = first
        while True:
            if kind == "delta" and data["text"]:
                streamed.append(data["text"])
                yield chunk.delta({"content": data["text"]} if spec.chat else data["text"])
            elif kind == "error":
                yield sse(job_error(data).body)
                break
            elif kind == "done":
                if data["finish_reason"] == "cancelled":
                    yield sse(job_error({"code": "cancelled", "message": "The job was cancelled"}).body)
                    break
                await save(spec, data)
                # Text the engine held back (a possible stop-string prefix) arrives only in `done`.
                sent = "".join(streamed)
                tail = data["text"][len(sent) :] if data["text"].startswith(sent) else ""
                yield chunk.last(tail, data["finish_reason"], data["stats"], run.queue_ms)
                if api_request.include_usage:
                    yield chunk.usage(data["stats"], run.queue_ms)
                break
            kind, data = await run.next()
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception:  # keep the protocol whole: an error chunk, then [DONE]
        log.exception("api stream for job %s failed", spec.id, extra={"job_id": spec.id})
        yield sse(ApiError(500, INTERNAL_ERROR, type="server_error").body)
        yield b"data: [DONE]\n\n"
    finally:
        await run.cancel_unless_finished()


class Chunks:
    """The SSE chunk bodies of one stream: chat.completion.chunk or text_completion."""

    def __init__(self, spec: JobSpec, include_usage: bool):
        self.spec = spec
        self.envelope = reply_envelope(spec, "chat.completion.chunk" if spec.chat else "text_completion")
        if include_usage:
            self.envelope["usage"] = None  # as OpenAI does: null on every chunk but the usage one

    def _choice(self, content, finish_reason=None) -> dict:
        key = "delta" if self.spec.chat else "text"
        return {"index": 0, key: content, "finish_reason": finish_reason, "logprobs": None}

    def delta(self, content) -> bytes:
        return sse({**self.envelope, "choices": [self._choice(content)]})

    def last(self, tail: str, finish_reason: str, stats: dict, queue_ms: float) -> bytes:
        content = ({"content": tail} if tail else {}) if self.spec.chat else tail
        choices = [self._choice(content, finish_reason)]
        return sse({**self.envelope, "choices": choices, "timings": timings(stats, queue_ms)})

    def usage(self, stats: dict, queue_ms: float) -> bytes:
        return sse(
            {**self.envelope, "choices": [], "usage": usage(stats), "timings": timings(stats, queue_ms)}
        )


# Characters that JSON leaves as they are but Python's str.splitlines() takes for line ends, and with it
# httpx's iter_lines(), which many SSE clients read a stream with: escaped, a chunk stays one line.
LINE_ENDS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict) -> bytes:
    text = json.dumps(payload, ensure_ascii=False).translate(LINE_ENDS_JSON_KEEPS)
    return b"data: " + text.encode() + b"\n\n"


def reply_envelope(spec: JobSpec, object_type: str) -> dict:
    prefix = "chatcmpl-" if spec.chat else "cmpl-"
    return {"id": prefix + spec.id, "object": object_type, "created": int(spec.created), "model": spec.model}


def usage(stats: dict) -> dict:
    """OpenAI's usage: the prompt tokens read from a cache (an earlier request's prefix) among the prompt's."""
    prompt, completion = stats["prompt_tokens"], stats["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)},
    }


def timings(stats: dict, queue_ms: float) -> dict:
    """llama.cpp's server timings (prompt = prefill of the tokens not in the cache, cache_n = those that were;
    predicted = the tokens after it; draft_n and draft_n_accepted = speculative decoding's drafted and accepted
    tokens) plus ttft, queue and the decode steps (tokens per step = (predicted_n - 1) / decode_steps)."""
    prompt_ms = stats["prefill_ms"]
    predicted_ms = max(stats["total_ms"] - prompt_ms, 0.0)
    cache_n = stats.get("cached_tokens", 0)
    prompt_n, predicted_n = stats["prompt_tokens"] - cache_n, stats["completion_tokens"]
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_second": prompt_n * 1000 / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_second": predicted_n * 1000 / predicted_ms if predicted_ms > 0 else 0.0,
        "draft_n": stats.get("draft_n", 0),
        "draft_n_accepted": stats.get("draft_n_accepted", 0),
        "decode_steps": stats.get("decode_steps", max(predicted_n - 1, 0)),
        "ttft_ms": stats["ttft_ms"],
        "queue_ms": queue_ms,
    }


# A worker, the queue or the job's record went away, or the machine ran short: the same request can pass later.
RETRYABLE = frozenset(
    {"worker_lost", "out_of_memory", "cancelled", "no_workers", "unavailable", "queue_down"}
    | {"queue_restarted", "stalled", "unknown_job"}  # lost to a restart, a stuck worker, a vanished record
)


def job_error(data: dict, counted: bool = False) -> ApiError:
    """A worker's error event as the HTTP error a client expects. `counted`: the job's end counted it in the
    error metrics already (JobRun.account), so the view must not count it again."""
    code = data.get("code") or "internal_error"
    message = data.get("message") or "The job failed"
    if code in ("invalid_request", "context_length_exceeded"):
        return ApiError(400, message, param=data.get("param"), code=code, counted=counted)
    # The ones worth a retry (the openai client retries a 503 by itself); a bug stays a 500.
    status = 503 if code in RETRYABLE else 500
    return ApiError(status, message, type="server_error", code=code, counted=counted)
