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
import codecs
import contextlib
import functools
import json
import logging
import uuid
from dataclasses import replace

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from redis.exceptions import RedisError

from common.events import InvalidRequest, unicode_text
from common.protocol import TERMINAL, JobSpec, QueueFull, VisitorBusy
from playground import metrics
from playground.api.auth import authenticate
from playground.api.errors import ApiError, body_too_large
from playground.api.params import IGNORED, ApiRequest, chat_messages, json_depth, parse_request
from playground.jobs import Lease, job_client, redis_back, served_models
from playground.limits import configured as limit_config
from playground.limits import ip_from_request, limiter, visitor
from playground.store import save_generation

log = logging.getLogger("playground.api")
INTERNAL_ERROR = "Internal server error (the details are in the server's log)"
STREAM_START_GRACE_S = 5.0
NO_WORKER_RETRY_S = 5
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
    """served_models' answer as /v1/models entries, by id: OpenAI's four fields, vLLM's max_model_len, and
    what a client needs to build a request (what its workers said in their last heartbeat; null until one has)."""
    return {
        name: {
            "id": name,
            "object": "model",
            "created": 0,  # unknown: models come and go with their workers
            "owned_by": "kog",
            "max_model_len": info["max_context"],  # vLLM's name for the context length
            "workers": info["workers"],
            "chat_template": info["chat"],  # whether /v1/chat/completions can render its messages
            "fim": info["fim"],  # whether /v1/completions takes a suffix and /infill works
            "fim_tokens": info["fim_tokens"],
            "logprobs": info["logprobs"],
            # its generation_config.json's sampling: the API's defaults for what a request leaves out
            "generation_defaults": info["sampling_defaults"],
            # {done, total} bytes while a worker is still fetching it from the Hub (absent otherwise)
            **({"download": info["download"]} if "download" in info else {}),
        }
        for name, info in sorted(models.items())
    }


@endpoint("GET")
async def models(request):
    return JsonResponse({"object": "list", "data": list((await known_models()).values())})


@endpoint("GET")
async def model_detail(request, model: str):
    models = await known_models()
    card = models.get(model) or models.get(model.removesuffix("/"))  # no id ends in "/"
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
    run, api_request, first = await start_job(request, body, chat)
    echo = run.spec.prompt if api_request.echo else None
    if not api_request.stream:
        return JsonResponse(await reply_body(request, api_request, run, first, echo))
    if api_request.n > 1:
        return stream_response(choices_stream(request, api_request, run, first, echo), run)
    try:
        return stream_response(job_stream(run, first, Chunks(run.spec, api_request.include_usage, echo)), run)
    except BaseException:  # the client left (CancelledError) or we failed: stop the job
        await run.cancel_unless_finished()
        raise


async def reply_body(request, api_request: ApiRequest, run: JobRun, first: tuple[str, dict],
                     echo: str | None) -> dict:  # fmt: skip
    """The non-streamed reply. n > 1: the choices one after another (the engine decodes one request at a time),
    each a job of its own and a request against the caller's budget, replied together."""
    bodies = []
    for index in range(api_request.n):
        if index:
            run, first = await submit_job(request, choice_spec(api_request.spec, index))
        try:
            event, logprobs = await run.until_end(first)
            bodies.append(await run.finish(event[1], logprobs, echo))
        except BaseException:  # the client left (CancelledError) or we failed: stop the job
            await run.cancel_unless_finished()
            raise
    body = bodies[0]  # its envelope, and the first choice's timings
    body["choices"] = [{**each["choices"][0], "index": index} for index, each in enumerate(bodies)]
    body["usage"] = choices_usage([each["usage"] for each in bodies])
    return body


def choice_spec(spec: JobSpec, index: int) -> JobSpec:
    """Choice `index` of a request: its own job, sampled with the request's seed + index (an int64) where it
    gives one."""
    params = dict(spec.params)
    if params.get("seed") is not None:
        params["seed"] = (params["seed"] + index + 2**63) % 2**64 - 2**63
    return replace(spec, id=uuid.uuid4().hex, params=params)


def choices_usage(usages: list[dict]) -> dict:
    """The choices' usage as OpenAI counts it: the prompt once, every choice's completion."""
    completion = sum(each["completion_tokens"] for each in usages)
    out = {
        **usages[0],
        "completion_tokens": completion,
        "total_tokens": usages[0]["prompt_tokens"] + completion,
    }
    if "completion_tokens_details" in out:
        out["completion_tokens_details"] = {
            key: sum(each["completion_tokens_details"][key] for each in usages)
            for key in out["completion_tokens_details"]
        }
    return out


async def choices_stream(request, api_request: ApiRequest, run: JobRun, first: tuple[str, dict],
                         echo: str | None):  # fmt: skip
    """The SSE lines of n choices: each choice's chunks in turn, under the first's envelope; then the usage
    chunk (when asked) and [DONE]. A choice that fails ends the stream with its error chunk."""
    envelope, usages = None, []
    for index in range(api_request.n):
        if index:
            try:
                run, first = await submit_job(request, choice_spec(api_request.spec, index))
            except ApiError as exc:
                yield sse(exc.body)
                yield DONE_LINE
                return
        chunks = Chunks(run.spec, include_usage=False, echo=echo, index=index, final=False)
        if envelope is None:
            envelope = chunks.envelope
            if api_request.include_usage:
                envelope["usage"] = None  # as OpenAI does: null on every chunk but the usage one
        chunks.envelope = envelope
        async for line in job_stream(run, first, chunks):
            yield line
        if chunks.done_stats is None:  # an error chunk went out
            yield DONE_LINE
            return
        usages.append(usage(chunks.done_stats))
    if api_request.include_usage:
        yield sse({**envelope, "choices": [], "usage": choices_usage(usages)})
    yield DONE_LINE


def stream_response(events, run: JobRun) -> StreamingHttpResponse:
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each chunk on at once
    run.cancel_unless_streaming_within(STREAM_START_GRACE_S)
    return response


async def start_job(
    request, body, chat: bool, fim: tuple[str, str] | None = None
) -> tuple[JobRun, ApiRequest, tuple[str, dict]]:
    """A generation's request checked, admitted and queued, and its first real event: (the run, the parsed
    request, that event). Every refusal is an ApiError, raised before any byte of the reply. `fim`: (prefix,
    suffix) of a fill-in-the-middle request, either possibly empty (/infill's cursor at an end of the file)."""
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
    spec = api_request.spec
    if fim is not None:
        spec.prompt, spec.suffix = fim
    serving(spec.model, served)
    if spec.template_kwargs and not served[spec.model].get("template_kwargs"):
        # a worker from before chat_template_kwargs would drop them (JobSpec.from_json leaves unknown fields out)
        raise ApiError(400, "chat_template_kwargs: no worker of this model renders them yet; send the request "
                       "without them", param="chat_template_kwargs", code="invalid_value")  # fmt: skip
    if spec.suffix is not None and not served[spec.model].get("fim"):
        raise ApiError(400, f"suffix: the model {spec.model!r} has no fill-in-the-middle tokens in its tokenizer, "
                       "so it cannot complete between a prompt and a suffix; GET /v1/models lists which models "
                       "can (fim: true)", param="suffix", code="fim_not_supported")  # fmt: skip
    if spec.prompt_ids is not None and not served[spec.model].get("prompt_ids"):
        raise ApiError(400, f"prompt: the workers of {spec.model!r} do not take a prompt as token ids (a stand-in "
                       "engine has no tokenizer); send it as text", param="prompt", code="invalid_value")  # fmt: skip
    if api_request.logprobs and not served[spec.model].get("logprobs"):
        raise ApiError(400, f"logprobs: the workers of {spec.model!r} do not compute them",
                       param="logprobs", code="invalid_value")  # fmt: skip
    run, first = await submit_job(request, spec)
    return run, api_request, first


def caller(request) -> tuple[str, str | None]:
    """(address, key id): a key has its own budget; without one, the client's address has (playground/limits.py)."""
    ip = ip_from_request(request, limit_config().trusted_proxies)
    return ip, str(request.api_key.pk) if request.api_key is not None else None


@contextlib.asynccontextmanager
async def admitted(ip: str, key_id: str | None):
    """The caller admitted against its budget, then the body queues its job: a refusal either way is a 429 with
    its Retry-After, and a request whose job was not queued is not charged."""
    verdict = await limiter().admit(ip, api_key=key_id)
    if not verdict.allowed:
        raise ApiError(429, verdict.message, type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(verdict.retry_after_s)})  # fmt: skip
    try:
        yield
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


async def submit_job(request, spec: JobSpec) -> tuple[JobRun, tuple[str, dict]]:
    """A checked job admitted against the caller's budget and queued, and its first real event."""
    ip, key_id = caller(request)
    run = JobRun(spec, ip, key_id)
    async with admitted(ip, key_id):
        await run.submit()

    try:
        # Wait for the job's first real event before any status line goes out, so that a refusal
        # from the worker (a prompt over the context) is still a plain 400, streaming or not.
        first = await run.next()
        if first[0] == "error":
            raise job_error(first[1], counted=True)
        if spec.prompt_ids is not None and first[0] == "prefilled":
            # the ids as text, decoded by the worker: what an echo begins with, and the saved run's prompt
            spec.prompt = first[1].get("prompt", "")
    except BaseException:
        await run.cancel_unless_finished()
        raise
    return run, first


def serving(model: str, served: dict[str, dict]) -> None:
    """ApiError unless `model` is known and a live worker serves it."""
    models = model_entries(served)
    if model not in models:
        message = f"The model {model!r} does not exist; served: {', '.join(models) or 'none'}"
        # OpenAI's status for it (the client raises NotFoundError), as GET /v1/models/<id> answers
        raise ApiError(404, message, param="model", code="model_not_found")
    if not models[model]["workers"]:
        # a lost worker is started again within seconds (playground/supervise.py, compose's restart)
        raise ApiError(503, f"No worker serves {model!r} right now", "server_error", code="no_workers",
                       headers={"Retry-After": str(NO_WORKER_RETRY_S)})  # fmt: skip


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

    async def until_end(self, first: tuple[str, dict]) -> tuple[tuple[str, dict], list[dict] | None]:
        """The job's `done` event (an error raises its ApiError) and its tokens' logprobs (None when the
        request asked for none; an echo's start with the prompt's), read on from `first`."""
        event, logprobs = first, None
        while True:
            if event[0] == "prefilled" and "prompt_logprobs" in event[1]:
                logprobs = event[1]["prompt_logprobs"] + (logprobs or [])
            if event[0] == "delta" and "logprobs" in event[1]:
                logprobs = (logprobs or []) + event[1]["logprobs"]
            if event[0] in TERMINAL:
                break
            event = await self.next()
        if event[0] == "error":
            raise job_error(event[1], counted=True)
        if event[1]["finish_reason"] == "cancelled":
            raise job_error({"code": "cancelled", "message": "The job was cancelled before it finished"})
        return event, logprobs

    async def finish(self, done: dict, logprobs: list[dict] | None = None, echo: str | None = None) -> dict:
        """The non-streamed body for a `done` event; `echo`: the prompt the text begins with."""
        await save(self.spec, done)
        body = reply_envelope(self.spec, "chat.completion" if self.spec.chat else "text_completion")
        if self.spec.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done["text"]}}
        else:
            choice = {"index": 0, "text": (echo or "") + done["text"]}
        # a reply that ended at once (its end token has no entry) still has the logprobs object it asked for
        asked = self.spec.params.get("logprobs") is not None
        shaped = openai_logprobs(logprobs or [], self.spec.chat) if asked else None
        body["choices"] = [{**choice, "finish_reason": done["finish_reason"], "logprobs": shaped,
                            "stop_reason": done.get("stop_reason")}]  # fmt: skip
        body["usage"] = usage(done["stats"])
        body["timings"] = timings(done["stats"], self.queue_ms)
        return body


DONE_LINE = b"data: [DONE]\n\n"


async def job_stream(run: JobRun, first: tuple[str, dict], chunks: Chunks | InfillChunks):
    """A job's events, read on from `first`, as the SSE lines `chunks` shapes them: the deltas, the last
    chunk (with the text the engine held back), or an error chunk; then the closing lines."""
    run.streaming = True
    streamed = []
    try:
        for line in chunks.opening():
            yield line
        kind, data = first
        while True:
            if kind == "prefilled" or (kind in ("delta", "done") and chunks.echo_pending):
                line = chunks.echo_line(data.get("prompt_logprobs") if kind == "prefilled" else None)
                if line is not None:
                    yield line
            if kind == "delta":
                line = chunks.delta(data)
                if line is not None:
                    streamed.append(data["text"])
                    yield line
            elif kind == "error":
                yield sse(job_error(data).body)
                break
            elif kind == "done":
                if data["finish_reason"] == "cancelled":
                    yield sse(job_error({"code": "cancelled", "message": "The job was cancelled"}).body)
                    break
                await save(run.spec, data)
                # Text the engine held back (a possible stop-string prefix) arrives only in `done`.
                sent = "".join(streamed)
                tail = data["text"][len(sent) :] if data["text"].startswith(sent) else ""
                for line in chunks.done(tail, data, run.queue_ms):
                    yield line
                break
            kind, data = await run.next()
        for line in chunks.closing():
            yield line
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception:  # keep the protocol whole: an error chunk, then the closing lines
        log.exception("%s stream for job %s failed", chunks.name, run.spec.id, extra={"job_id": run.spec.id})
        yield sse(ApiError(500, INTERNAL_ERROR, type="server_error").body)
        for line in chunks.closing():
            yield line
    finally:
        await run.cancel_unless_finished()


class Chunks:
    """The SSE lines of one OpenAI stream: chat.completion.chunk or text_completion chunks, then [DONE]."""

    name = "api"

    def __init__(self, spec: JobSpec, include_usage: bool, echo: str | None = None, index: int = 0,
                 final: bool = True):  # fmt: skip
        """index: the choice these chunks carry; final: the stream ends with them ([DONE])."""
        self.spec = spec
        self.include_usage = include_usage
        self.index, self.final = index, final
        self.done_stats: dict | None = None  # the job's stats, once its last chunk is out
        self.echo, self.echo_pending = echo, echo is not None  # the prompt, sent as the first text chunk
        self.offsets = TextOffsets()
        self.envelope = reply_envelope(spec, "chat.completion.chunk" if spec.chat else "text_completion")
        if include_usage:
            self.envelope["usage"] = None  # as OpenAI does: null on every chunk but the usage one

    def _choice(self, content, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
        key = "delta" if self.spec.chat else "text"
        return {"index": self.index, key: content, "finish_reason": finish_reason, "logprobs": logprobs,
                "stop_reason": stop_reason}  # fmt: skip

    def opening(self) -> list[bytes]:
        return [self._line({"role": "assistant", "content": ""})] if self.spec.chat else []

    def echo_line(self, prompt_logprobs: list[dict] | None) -> bytes | None:
        """The echoed prompt's chunk (with its tokens' logprobs where the job scored them), once."""
        if not self.echo_pending:
            return None
        self.echo_pending = False
        return self._line(self.echo, prompt_logprobs)

    def delta(self, data: dict) -> bytes | None:
        """A delta event's chunk (None when it has neither text nor logprobs)."""
        if not (data["text"] or data.get("logprobs")):
            return None
        content = {"content": data["text"]} if self.spec.chat else data["text"]
        return self._line(content, data.get("logprobs"))

    def _line(self, content, logprobs: list[dict] | None = None) -> bytes:
        """`logprobs`: the worker's entries for this chunk's tokens."""
        shaped = None if logprobs is None else openai_logprobs(logprobs, self.spec.chat, self.offsets)
        return sse({**self.envelope, "choices": [self._choice(content, logprobs=shaped)]})

    def done(self, tail: str, done: dict, queue_ms: float) -> list[bytes]:
        """The last chunk (finish_reason, timings), then the usage chunk when the request asked for it."""
        stats = self.done_stats = done["stats"]
        content = ({"content": tail} if tail else {}) if self.spec.chat else tail
        choices = [self._choice(content, done["finish_reason"], stop_reason=done.get("stop_reason"))]
        lines = [sse({**self.envelope, "choices": choices, "timings": timings(stats, queue_ms)})]
        if self.include_usage:
            usage_body = {"choices": [], "usage": usage(stats), "timings": timings(stats, queue_ms)}
            lines.append(sse({**self.envelope, **usage_body}))
        return lines

    def closing(self) -> list[bytes]:
        return [DONE_LINE] if self.final else []


class InfillChunks:
    """The SSE lines of one llama.cpp /infill stream: `{content, stop: false}` per delta, then the last body
    (stop: true, its timings); no [DONE] line, as llama.cpp sends none."""

    name = "infill"
    echo_pending = False  # /infill has no echo

    def __init__(self, run: JobRun):
        self.run = run

    def opening(self) -> list[bytes]:
        return []

    def echo_line(self, prompt_logprobs: list[dict] | None) -> None:
        return None

    def delta(self, data: dict) -> bytes | None:
        return sse(infill_body(self.run, data["text"], None)) if data["text"] else None

    def done(self, tail: str, done: dict, queue_ms: float) -> list[bytes]:
        return [sse(infill_body(self.run, tail, done))]

    def closing(self) -> list[bytes]:
        return []


# Characters that JSON leaves as they are but Python's str.splitlines() takes for line ends, and with it
# httpx's iter_lines(), which many SSE clients read a stream with: escaped, a chunk stays one line.
LINE_ENDS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict) -> bytes:
    text = json.dumps(payload, ensure_ascii=False).translate(LINE_ENDS_JSON_KEEPS)
    return b"data: " + text.encode() + b"\n\n"


def reply_envelope(spec: JobSpec, object_type: str) -> dict:
    prefix = "chatcmpl-" if spec.chat else "cmpl-"
    return {"id": prefix + spec.id, "object": object_type, "created": int(spec.created), "model": spec.model}


class TextOffsets:
    """The legacy completions' text_offset: where each token starts in the choice's text, counted over the
    tokens in order (an echoed prompt's first), across the chunks of a stream. The text is the tokens' bytes
    decoded with U+FFFD for what is not UTF-8: a token that holds part of a character starts where that
    character does, bytes left unfinished before a token that does not continue them are a U+FFFD before it (a
    U+FFFD each where byte-fallback tokens held them, as SentencePiece's decoder shows them), and a special
    token (a BOS, an end token generated under ignore_eos) adds nothing."""

    def __init__(self):
        self.chars = 0
        self.unfinished = b""  # the start of a character whose other bytes have not come yet
        self.by_bytes = False  # those bytes came from byte-fallback tokens

    def take(self, entries: list[dict]) -> list[int]:
        offsets = []
        for entry in entries:
            if entry.get("special"):
                offsets.append(self.chars)
                continue
            data = bytes(entry["bytes"])
            if self.unfinished and not continues(self.unfinished, data):
                replaced = len(self.unfinished.decode(errors="replace"))  # U+FFFDs: one per maximal bad part
                self.chars += len(self.unfinished) if self.by_bytes else replaced
                self.unfinished = b""
            offsets.append(self.chars)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self.chars += len(decoder.decode(self.unfinished + data))
            self.unfinished = decoder.getstate()[0]
            self.by_bytes = bool(self.unfinished) and bool(entry.get("byte_fallback"))
        return offsets


def continues(unfinished: bytes, data: bytes) -> bool:
    """Whether `data` goes on with the character that `unfinished` (a valid start of one) begins."""
    lead = unfinished[0]
    size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    try:
        codecs.getincrementaldecoder("utf-8")().decode(unfinished + data[: size - len(unfinished)])
    except UnicodeDecodeError:
        return False
    return bool(data)


def openai_logprobs(entries: list[dict], chat: bool, offsets: TextOffsets | None = None) -> dict:
    """The worker's per-token entries ({id, token, bytes, logprob, top: [...], special?}) in OpenAI's shapes:
    chat's {content: [{token, logprob, bytes, top_logprobs}]}, the legacy completions' parallel lists;
    `offsets`: the text offsets counted so far (a stream's), else these entries are the whole choice's."""
    if chat:

        def item(entry: dict) -> dict:
            return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}

        content = [{**item(e), "top_logprobs": [item(t) for t in e["top"]]} for e in entries]
        return {"content": content, "refusal": None}
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # as vLLM: the most likely tokens, the chosen one included
        "top_logprobs": [top_by_text([*e["top"], e]) if e["top"] else None for e in entries],
        "text_offset": (offsets or TextOffsets()).take(entries),
    }


def top_by_text(entries: list[dict]) -> dict[str, float]:
    """{token text: logprob}, most likely first; where two ids spell the same text the likelier one stays."""
    shown: dict[str, float] = {}
    for entry in entries:
        shown.setdefault(entry["token"], entry["logprob"])
    return shown


def usage(stats: dict) -> dict:
    """OpenAI's usage: the prompt tokens read from a cache (an earlier request's prefix) among the prompt's; with
    a prediction, its drafts the model accepted and those it rejected."""
    prompt, completion = stats["prompt_tokens"], stats["completion_tokens"]
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)},
    }
    if stats.get("prediction_tokens"):
        accepted = stats.get("prediction_draft_n_accepted", 0)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": stats.get("prediction_draft_n", 0) - accepted,
        }
    return out


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


# ---- tokens, and llama.cpp's /infill ---------------------------------------------------------------------
TASK_TIMEOUT_S = 30.0  # a tokenize job waits in its model's queue behind the generation in progress


@endpoint("POST")
async def tokenize(request):
    """vLLM's POST /tokenize: {model, prompt, add_special_tokens} or {model, messages} -> {count,
    max_model_len, tokens}; the ids are the ones a generation of that prompt reads."""
    body = json_object(request)
    if "messages" in body and body["messages"] is not None:
        messages = parse_messages(body["messages"])
        chars = sum(len(m["content"]) for m in messages)
        if chars > settings.PLAYGROUND_MAX_PROMPT_CHARS:  # as /v1/chat/completions counts a chat
            raise ApiError(400, f"messages: is {chars} characters long; the server takes at most "
                           f"{settings.PLAYGROUND_MAX_PROMPT_CHARS}", param="messages", code="invalid_value")  # fmt: skip
        spec_fields = {"messages": messages, "chat": True}
    else:
        prompt = body.get("prompt", body.get("content"))  # llama.cpp names it content
        if not isinstance(prompt, str):
            raise ApiError(
                400, "prompt: must be a string (or messages: a chat)", param="prompt", code="invalid_value"
            )
        spec_fields = {"prompt": check_text(prompt, "prompt")}
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise ApiError(
            400, "add_special_tokens: must be a boolean", param="add_special_tokens", code="invalid_value"
        )
    return JsonResponse(
        await run_task(request, body, "tokenize", add_special_tokens=add_special, **spec_fields)
    )


@endpoint("POST")
async def detokenize(request):
    """vLLM's POST /detokenize: {model, tokens} -> {prompt}."""
    body = json_object(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(400, "tokens: must be a list of token ids", param="tokens", code="invalid_value")
    if len(tokens) > settings.PLAYGROUND_MAX_PROMPT_CHARS:
        raise ApiError(400, f"tokens: at most {settings.PLAYGROUND_MAX_PROMPT_CHARS} ids", param="tokens",
                       code="invalid_value")  # fmt: skip
    return JsonResponse(await run_task(request, body, "detokenize", token_ids=tokens))


def json_object(request) -> dict:
    body = json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object", param="body", code="invalid_value")
    return body


def check_text(text: str, field: str) -> str:
    try:
        unicode_text(text, field)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=field, code="invalid_value") from None
    if len(text) > settings.PLAYGROUND_MAX_PROMPT_CHARS:
        raise ApiError(400, f"{field}: is {len(text)} characters long; the server takes at most "
                       f"{settings.PLAYGROUND_MAX_PROMPT_CHARS}", param=field, code="invalid_value")  # fmt: skip
    return text


def parse_messages(messages) -> list[dict]:
    try:
        return chat_messages(messages)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=exc.field, code="invalid_value") from None


async def run_task(request, body: dict, task: str, **spec_fields) -> dict:
    """A tokenizer job for `body`'s model (the first served one when it names none): its `done` data."""
    jobs = job_client()
    served = served_models(await jobs.workers())
    model = body.get("model")
    if model is None:
        model = next((name for name, info in served.items() if info["workers"]), None)
        if model is None:
            raise ApiError(503, "No worker is up", "server_error", code="no_workers",
                           headers={"Retry-After": str(NO_WORKER_RETRY_S)})  # fmt: skip
    if not isinstance(model, str):
        raise ApiError(400, "model: must be a string", param="model", code="invalid_value")
    serving(model, served)
    if not served[model].get("tokenize"):
        raise ApiError(400, f"The model {model!r} has no tokenizer to ask (a stand-in engine)", param="model",
                       code="invalid_value")  # fmt: skip
    spec = JobSpec(model, task=task, source="api", id=request.request_id, **spec_fields)
    ip, key_id = caller(request)  # a request like a generation: the caller's budget, its turn and job cap
    async with admitted(ip, key_id):
        await jobs.submit(spec, visitor=visitor(ip, key_id))
    try:
        async with asyncio.timeout(TASK_TIMEOUT_S):
            kind, data = await jobs.outcome(spec.id, block_ms=100, known=True)
    except TimeoutError:
        await jobs.cancel(spec.id)
        raise ApiError(503, f"The model's worker did not answer within {TASK_TIMEOUT_S:g} s (it is busy); "
                       "please try again", "server_error", code="busy") from None  # fmt: skip
    except BaseException:  # the client left: a queued job would hold its place and the caller's job slot
        await jobs.cancel(spec.id)
        raise
    await jobs.forget(spec.id)  # read: nothing else asks for it
    if kind == "error":
        raise job_error(data)
    return data


# llama.cpp's /infill fields and the /v1/completions field each one is
INFILL_FIELDS = {"n_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "seed": "seed", "stop": "stop", "stream": "stream", "model": "model",
                 "repeat_penalty": "repetition_penalty", "n_indent": "n_indent", "prediction": "prediction"}  # fmt: skip
INFILL_NAMES = {completion: infill for infill, completion in INFILL_FIELDS.items()}


def in_infill_terms(exc: ApiError) -> ApiError:
    """A refusal of a completion field, named as /infill's client sent it (n_predict, not max_tokens)."""
    error = exc.body["error"]
    param = error["param"]
    name = INFILL_NAMES.get(param, param)
    if name == param:
        return exc
    message = error["message"]
    message = name + message[len(param) :] if message.startswith(param + ":") else message
    return ApiError(exc.status, message, type=error["type"], param=name, code=error["code"],
                    headers=exc.headers, counted=exc.counted)  # fmt: skip


@endpoint("POST")
async def infill(request):
    """llama.cpp's POST /infill: {input_prefix, input_suffix, prompt, n_predict, ...} -> {content, stop,
    tokens_predicted, tokens_evaluated, timings}, streamed as `data: {content, stop}` lines. `prompt` (the start
    of the middle, already typed) goes after the prefix. input_extra (other files) is refused."""
    body = json_object(request)
    if body.get("input_extra"):
        raise ApiError(400, "input_extra: other files as context are not supported", param="input_extra",
                       code="invalid_value")  # fmt: skip
    prefix, suffix = body.get("input_prefix", ""), body.get("input_suffix", "")
    typed = body.get("prompt") or ""
    for name, value in (("input_prefix", prefix), ("input_suffix", suffix), ("prompt", typed)):
        if not isinstance(value, str):
            raise ApiError(400, f"{name}: must be a string", param=name, code="invalid_value")
    known = {"input_prefix", "input_suffix", "prompt", "input_extra", *INFILL_FIELDS}
    unknown = sorted(set(body) - known - IGNORED)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not a field of /infill here (it takes {', '.join(sorted(known))})",
                       param=unknown[0], code="invalid_value")  # fmt: skip
    completion = {INFILL_FIELDS[k]: v for k, v in body.items() if k in INFILL_FIELDS and v is not None}
    if type(completion.get("max_tokens")) is int and completion["max_tokens"] == -1:
        del completion["max_tokens"]  # llama.cpp's n_predict -1: no limit of the client's own
    completion.setdefault("model", body.get("model") or await first_fim_model())
    completion.setdefault("max_tokens", settings.PLAYGROUND_MAX_NEW_TOKENS)  # llama.cpp: until it stops
    prefix = check_text(prefix + typed, "input_prefix")
    check_text(suffix, "input_suffix")
    completion["prompt"] = "-"  # parse_request's placeholder: the job takes (prefix, suffix) below
    try:
        run, api_request, first = await start_job(request, completion, chat=False, fim=(prefix, suffix))
    except ApiError as exc:
        raise in_infill_terms(exc) from None
    try:
        if api_request.stream:
            return stream_response(job_stream(run, first, InfillChunks(run)), run)
        (_, done), _ = await run.until_end(first)
        await save(run.spec, done)
        return JsonResponse(infill_body(run, done["text"], done))
    except BaseException:
        await run.cancel_unless_finished()
        raise


async def first_fim_model() -> str:
    served = served_models(await job_client().workers())
    return next((name for name, info in served.items() if info["workers"] and info["fim"]), "")


# llama.cpp's stop_type for what ended an infill: a stop word, the token limit or the indentation rule, the end
INFILL_STOP_TYPES = {
    "stop_string": "word",
    "length": "limit",
    "indent": "limit",
    "eos": "eos",
    "stop_token": "eos",
}


def infill_body(run: JobRun, content: str, done: dict | None) -> dict:
    if done is None:
        return {"content": content, "stop": False}
    stats = done["stats"]
    ended_by = done.get("ended_by") or ("length" if done["finish_reason"] == "length" else "eos")
    word = {"stopping_word": done["stop_reason"]} if ended_by == "stop_string" else {}
    return {
        "content": content,
        "stop": True,
        "model": run.spec.model,
        "stop_type": INFILL_STOP_TYPES.get(ended_by, "eos"),
        **word,
        "tokens_predicted": stats["completion_tokens"],
        "tokens_evaluated": stats["prompt_tokens"],
        "timings": timings(stats, run.queue_ms),
    }
