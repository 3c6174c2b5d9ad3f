"""The web process's side of the job queue: a JobClient per event loop, a follower's lease on its job,
the live workers in a form the page shows, and the page's request turned into a JobSpec (validated once,
here)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import uuid
import weakref

from django.conf import settings
from redis import Redis
from redis.exceptions import RedisError

from common.code_blocks import cursor_block_indent
from common.events import InvalidRequest, SamplingParams, unicode_text
from common.protocol import LEASE_INTERVAL_S, JobClient, JobSpec, connect, release_leases

log = logging.getLogger("playground.jobs")

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
# Settings the page has no field for: a request that leaves them out gets the model's recommended ones
PAGE_LESS_PARAMS = ("top_k", "repetition_penalty")


def job_client() -> JobClient:
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    url = settings.REDIS_URL
    if url not in per_loop:
        # No socket_timeout: redis-py then wraps every send in asyncio.wait_for, which on Python 3.11
        # can swallow a task cancellation (CPython gh-86296) and so keep a worker busy for a gone client.
        # Retries and a blocking pool (protocol.connect): a Redis restart or 200 sockets following
        # their jobs at once wait for a connection instead of failing.
        r = connect(
            url, use_asyncio=True, max_connections=settings.PLAYGROUND_REDIS_CONNECTIONS, socket_timeout=None
        )
        per_loop[url] = JobClient(
            r,
            max_queue=settings.PLAYGROUND_MAX_QUEUE,
            max_per_visitor=settings.PLAYGROUND_MAX_JOBS_PER_VISITOR,
        )
    return per_loop[url]


async def recent_workers(jobs: JobClient, max_age_s: float) -> list[dict]:
    """The live workers as read at most `max_age_s` ago: the page's sockets each show the workers' status every
    PLAYGROUND_STATUS_INTERVAL_S, and one read (shared while it runs) serves every socket of this process."""
    now = asyncio.get_running_loop().time()
    read_at, read = getattr(jobs, "_recent_workers", (None, None))
    if read is None or now - read_at >= max_age_s:
        read = asyncio.ensure_future(jobs.workers())
        jobs._recent_workers = (now, read)
    return await asyncio.shield(read)  # a socket that closes meanwhile does not cancel the others' read


class Lease:
    """One follower's hold on a job (a page's socket following it, an API request streaming or waiting for
    it): renewed every LEASE_INTERVAL_S in the background until released or the job has ended. A job whose
    leases have all lapsed for longer than its grace is cancelled by its worker, so a web process that dies,
    SIGKILL included, stops the jobs it alone followed (common/protocol.py: followers)."""

    def __init__(self, jobs: JobClient, job_id: str):
        self.jobs, self.job_id = jobs, job_id
        self.follower = uuid.uuid4().hex
        self.redis_url = settings.REDIS_URL  # for the release at exit, which has no event loop left
        self._task: asyncio.Task | None = None

    async def take(self) -> bool:
        """Take the lease on a job submitted by someone else; False when the job has ended already."""
        return await self.jobs.lease(self.job_id, self.follower)

    def keep(self) -> None:
        """Renew the lease from now on (submit() or take() took it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._renew())
            _held.add(self)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(LEASE_INTERVAL_S)
            try:
                if not await self.jobs.lease(self.job_id, self.follower):
                    _held.discard(self)
                    return  # the job has ended: nothing left to hold
            except RedisError:
                pass  # the follower itself waits for Redis and says what became of the job

    def stop(self) -> None:
        """Stop renewing: the lease lapses by itself within LEASE_TTL_S."""
        if self._task is not None:
            self._task.cancel()
        _held.discard(self)

    async def release(self) -> None:
        """Stop following: the lease lapses now, and the job's grace counts from here."""
        self.stop()
        try:
            await self.jobs.release(self.job_id, self.follower)
        except RedisError as exc:  # it lapses by itself within LEASE_TTL_S
            log.warning("could not release the lease on %s: %s", self.job_id, exc)


_held: weakref.WeakSet[Lease] = weakref.WeakSet()  # the leases this process renews


@atexit.register
def _release_held_leases() -> None:
    """daphne asked to stop (SIGTERM) exits without closing its sockets' and requests' handlers: their
    leases lapse here, at once, so that the jobs' grace starts now (a SIGKILL leaves them to lapse within
    LEASE_TTL_S). Best effort, and quick: an unreachable Redis does not hold the exit up."""
    by_url: dict[str, list[tuple[str, str]]] = {}
    for lease in list(_held):
        by_url.setdefault(lease.redis_url, []).append((lease.job_id, lease.follower))
    for url, leases in by_url.items():
        try:
            r = Redis.from_url(url, decode_responses=True, socket_connect_timeout=1, socket_timeout=1)
            release_leases(r, leases)
            r.close()
        except Exception as exc:  # noqa: BLE001 - the process is on its way out either way
            log.warning("could not release %d leases at exit: %s", len(leases), exc)


async def redis_back(jobs: JobClient, deadline: float) -> bool:
    """Wait until Redis answers again, or until `deadline` (the loop's clock): whether it came back."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            await jobs.r.ping()
            return True
        except RedisError:
            await asyncio.sleep(0.5)
    return False


# What a worker's heartbeat says of each model it serves that the web uses
MODEL_INFO_KEYS = (
    "chat", "base", "max_context", "sampling_defaults", "template_kwargs", "fim", "fim_tokens", "logprobs",
    "tokenize", "prompt_ids",
)  # fmt: skip


def served_models(workers: list[dict]) -> dict[str, dict]:
    """Model name -> {chat, max_context, sampling_defaults, workers, ...; download: {done, total} bytes while a
    loading worker fetches it from the Hub}: the configured models (MODELS) and any other model a
    live worker serves; a configured one is listed while no worker is up for it (its jobs queue until
    one starts). Models with a live worker come first (the first one is the page's default), then in
    MODELS' order, then by name: never in heartbeat order, so the page's picker holds still."""
    configured = {name: i for i, name in enumerate(settings.PLAYGROUND_MODELS)}

    def unknown() -> dict:  # until a worker says
        return {
            "chat": False,
            "base": False,
            "max_context": None,
            "sampling_defaults": {},
            "template_kwargs": False,
            "fim": False,
            "fim_tokens": None,
            "logprobs": False,
            "tokenize": False,
            "prompt_ids": False,
            "workers": 0,
        }

    models = {name: unknown() for name in configured}
    for worker in workers:
        for name, progress in worker.get("downloads", {}).items():  # a worker still fetching it from the Hub
            if progress["done"] < progress["total"]:
                models.setdefault(name, unknown())["download"] = progress
        info = worker.get("model_info", {})
        for name in worker.get("models", []):
            entry = models.setdefault(name, unknown())
            entry.update({k: v for k, v in info.get(name, {}).items() if k in MODEL_INFO_KEYS})
            entry["workers"] += 1

    def order(name: str) -> tuple:
        return not models[name]["workers"], configured.get(name, len(configured)), name

    return {name: models[name] for name in sorted(models, key=order)}


def worker_summary(workers: list[dict]) -> dict:
    """What the page's status pill and model picker show; compared between polls to send changes only."""
    models = served_models(workers)
    workers = [w for w in workers if not w.get("loading")]  # one still loading its models serves nothing yet
    return {
        "up": bool(workers),
        "count": len(workers),
        "busy": sum(1 for w in workers if w.get("job")),
        "devices": sorted({str(w.get("device", "?")) for w in workers}),
        "models": [{"name": name, **info} for name, info in models.items()],
    }


# The page's sliders have ranges; a number outside one (a hand-written frame) is brought inside it
# rather than refused. Values of the wrong type, NaN and infinities are still refused.
RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.01, 1.0),
    "top_k": (0, 1000),
    "repetition_penalty": (0.5, 2.0),
    "max_new_tokens": (1, None),  # the upper end is PLAYGROUND_MAX_NEW_TOKENS
}


def clamp(field: str, value):
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return value  # SamplingParams names the field and what it must be
    if field == "seed":
        return value % 2**63 if isinstance(value, int) else value  # what torch's generator accepts
    if field not in RANGES or (isinstance(value, float) and field in ("top_k", "max_new_tokens")):
        return value
    low, high = RANGES[field]
    high = settings.PLAYGROUND_MAX_NEW_TOKENS if high is None else high
    return min(max(value, low), high)


def history_turns(history, prompt_chars: int) -> list[tuple[str, str]]:
    """A follow-up's earlier turns, oldest first, from the frame's `history`: [{"prompt", "answer"}, ...].
    The whole conversation counts against the prompt's character limit: it is all prompt to the model."""
    if history is None:
        return []
    if not isinstance(history, list):
        raise InvalidRequest("history", "must be a list of earlier turns, each {prompt, answer}")
    turns, chars = [], prompt_chars
    for i, turn in enumerate(history):
        if not isinstance(turn, dict) or not all(
            isinstance(turn.get(key), str) for key in ("prompt", "answer")
        ):
            raise InvalidRequest(
                f"history[{i}]", "must be an object with a prompt and an answer, both strings"
            )
        if not turn["prompt"].strip():
            raise InvalidRequest(f"history[{i}].prompt", "must be a non-empty string")
        turns.append(
            (
                unicode_text(turn["prompt"], f"history[{i}].prompt"),
                unicode_text(turn["answer"], f"history[{i}].answer"),
            )
        )
        chars += len(turn["prompt"]) + len(turn["answer"])
    limit = settings.PLAYGROUND_MAX_PROMPT_CHARS
    if chars > limit:
        raise InvalidRequest(
            "history",
            f"the conversation is {chars:,} characters with this prompt; the limit is {limit:,}: start a new chat",
        )
    return turns


def spec_from_frame(frame: dict, models: dict[str, dict]) -> JobSpec:
    """A `generate` frame -> JobSpec. Raises InvalidRequest naming the page's field."""
    prompt = frame.get("prompt")
    suffix = frame.get(
        "suffix"
    )  # code completion: the code after the cursor (the prompt: the code before it)
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("suffix", "must be a string")
    if not isinstance(prompt, str) or (not prompt.strip() and not (suffix or "").strip()):
        raise InvalidRequest("prompt", "must be a non-empty string")
    if len(prompt) + len(suffix or "") > settings.PLAYGROUND_MAX_PROMPT_CHARS:
        raise InvalidRequest("prompt", f"must be at most {settings.PLAYGROUND_MAX_PROMPT_CHARS} characters")
    unicode_text(prompt, "prompt")
    if suffix is not None:
        unicode_text(suffix, "suffix")
    history = history_turns(frame.get("history"), len(prompt))
    system = frame.get("system_prompt")
    system = "" if system is None else system
    if not isinstance(system, str):
        raise InvalidRequest("system_prompt", "must be a string")
    unicode_text(system, "system_prompt")

    model = frame.get("model")
    model = next(iter(models), None) if model in (None, "") else model  # served_models' first: a live one
    if model is None:
        raise InvalidRequest(
            "model", "no worker is up and MODELS is unset: start `python -m inference.worker`"
        )
    if not isinstance(model, str) or model not in models:
        raise InvalidRequest("model", f"unknown model {model!r}; available: {', '.join(models) or 'none'}")

    params = {
        field: clamp(field, frame[name])
        for name, field in PARAM_FIELDS.items()
        if frame.get(name) is not None
    }
    # what the page has no field for, the model's generation_config.json recommends: its repetition guard
    recommended = models[model].get("sampling_defaults") or {}
    for field in PAGE_LESS_PARAMS:
        if field not in params and recommended.get(field) is not None:
            params[field] = clamp(field, recommended[field])
    try:
        SamplingParams(**params)
    except InvalidRequest as exc:
        page_name = {field: name for name, field in PARAM_FIELDS.items()}.get(exc.field, exc.field)
        raise InvalidRequest(page_name, exc.message) from None

    if suffix is not None:  # code completion: the middle between the two, whatever the model's chat template
        if not models[model].get("fim"):
            raise InvalidRequest(
                "suffix",
                f"{model} has no fill-in-the-middle tokens: pick a model that has, or turn code completion off",
            )
        # the reply ends where the block the cursor is in does, not at the token limit past it
        params = {**params, "n_indent": cursor_block_indent(prompt)}
        return JobSpec(model=model, prompt=prompt, suffix=suffix, params=params, source="web")
    if models[model].get("chat"):
        messages = [{"role": "system", "content": system}] if system else []
        for earlier_prompt, answer in history:
            messages += [
                {"role": "user", "content": earlier_prompt},
                {"role": "assistant", "content": answer},
            ]
        messages.append({"role": "user", "content": prompt})
        return JobSpec(model=model, messages=messages, chat=True, params=params, source="web")
    if history:
        raise InvalidRequest(
            "history",
            f"{model} continues text and holds no conversation: start a new chat or pick a chat model",
        )
    # A completion model has no roles: the system prompt is simply the start of the text.
    text = f"{system}\n\n{prompt}" if system else prompt
    return JobSpec(model=model, prompt=text, params=params, source="web")
