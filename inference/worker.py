"""The inference worker: loads its models once, takes jobs from Redis, streams tokens back.

    python -m inference.worker [--model DIR_OR_PRESET ...] [--redis-url URL] [--device cpu|cuda]

Models come from --model, else $MODELS (comma-separated), else the shipped default model; a model
named `standin:<tokens/s>` is the torch-free stand-in engine (inference/standin.py). Any number of
workers, on any machines, may serve the same queues: each job goes to exactly one.
With $KOG_HEALTH_FILE set, each heartbeat also touches that file (a container healthcheck reads it).

Faults it survives: a job that raises (the client gets an error event; GPU out of memory says so
and frees the cache), Redis going away (it retries and serves again once Redis is back; a job
whose Redis state vanished is stopped), a job that nobody follows any more (every lease on it lapsed
past its grace: its page closed, its API client or its whole web process gone; it is stopped at its
next flush, or ended unstarted), and a token stall: when no token comes for KOG_STALL_TIMEOUT_S
seconds (default 60) a watchdog thread ends the job with a `stalled` error, and the generation loop
stops at its next token. If the loop is still stuck KOG_STALL_EXIT_S
seconds later (default 60; 0: never) the process exits, for its supervisor to restart it.
KOG_MAX_PROMPT_TOKENS caps prompts below the context (default 0: no cap but the context).
--gpus N (KOG_GPUS) serves one Laneformer with its lanes divided among N processes (inference/lanes_runner.py).
A model it cannot load (a checkpoint it does not support, a broken file, no GPU for --device cuda, a device
without the memory for its weights or KV cache) ends it at start with one log line that names the model and
the reason, and exit status 78. Before any model loads, a setting it cannot use (a KOG_* variable that is
not a number, two models served under one name, a REDIS_URL that is no Redis URL) ends it with one line and
exit status 2, and a Redis it cannot reach with one line and exit status 69.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import redis

from common.env import EnvError, env_number
from common.events import Done, InvalidRequest, Prefilled, TextDelta
from common.logs import configure_logging, job_context
from common.names import ModelNameError, configured_models, model_source, served_name, served_names
from common.protocol import HEARTBEAT_INTERVAL_S, STALL_EXIT_CODE, JobSpec, WorkerChannel, connect
from common.redis_server import redacted_url, url_problem
from inference.config import env_max_context, env_prefix_slots
from inference.failures import is_device_error, is_memory_error
from inference.speculative import SpeculationSettings
from inference.standin import PREFIX as STANDIN_PREFIX
from inference.standin import StandinEngine
from inference.tokenizer_build import continues_code

log = logging.getLogger("inference.worker")

LOAD_EXIT_CODE = 78  # EX_CONFIG: what it was told to serve cannot be served
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
USAGE_EXIT_CODE = 2  # a setting it cannot use, found before anything loads
REDIS_EXIT_CODE = 69  # EX_UNAVAILABLE: the Redis it was given does not answer
DEVICES = ("cpu", "cuda", "cuda:N")  # cuda:N: the Nth GPU (one worker per GPU), as torch names it
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # engine.DTYPES' names, known here without torch
BACKENDS = ("reference", "fast")  # KOG_BACKEND, read by engine._make_runner

# Settings from the environment (read_settings); the values a Worker built in code starts with.
FLUSH_INTERVAL_S = 0.025  # KOG_FLUSH_MS: coalescing, 16-50 ms per frame
STALL_TIMEOUT_S = 60.0
STALL_EXIT_S = 60.0
# A public demo's cap on prompt length, below the context (0: the context is the only limit). The
# web process has no tokenizer, so the cap on tokens is kept here.
MAX_PROMPT_TOKENS = 0


def read_settings() -> None:
    """The KOG_* settings of this module from the environment; EnvError names a variable it cannot use and
    what that variable takes (main() ends in one line then, before anything loads)."""
    global FLUSH_INTERVAL_S, STALL_TIMEOUT_S, STALL_EXIT_S, MAX_PROMPT_TOKENS
    FLUSH_INTERVAL_S = env_number("KOG_FLUSH_MS", 25.0, "a number of milliseconds >= 0") / 1000
    STALL_TIMEOUT_S = env_number(
        "KOG_STALL_TIMEOUT_S", 60.0, "a number of seconds >= 0 (0: no stall watchdog)"
    )
    STALL_EXIT_S = env_number("KOG_STALL_EXIT_S", 60.0, "a number of seconds >= 0 (0: never exit)")
    MAX_PROMPT_TOKENS = int(
        env_number("KOG_MAX_PROMPT_TOKENS", 0, "an integer >= 0 (tokens; 0: no cap)", integer=True)
    )


# What the environment holds at import applies at once; a value it cannot use is left at its default here,
# for main() to refuse.
with contextlib.suppress(EnvError):
    read_settings()


class DeltaCoalescer:
    """Sends the first token at once, then at most one delta entry per FLUSH_INTERVAL_S.

    Each delta carries the worker-side clock: `t` (last token), `t_first` (first token) and `n`
    (tokens so far), so a client computes decode tokens/s = (n - 1) / (t - t_first) from any entry; and the
    speculation so far: `steps` (model steps after the first token, so tokens per step = (n - 1) / steps),
    `draft_n` and `draft_n_accepted` (acceptance rate = draft_n_accepted / draft_n).
    """

    def __init__(self, publish, flush_interval_s: float | None = None):
        self.publish = publish
        self.flush_interval_s = FLUSH_INTERVAL_S if flush_interval_s is None else flush_interval_s
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = None  # with a request's logprobs: one entry per token of the text
        self.n = 0
        self.t_first: float | None = None
        self.t_last = 0.0
        self.last_flush = 0.0
        self.steps = self.draft_n = self.draft_n_accepted = 0

    def add(self, delta: TextDelta) -> bool:
        """Buffer a delta; returns True when it flushed (the moment to look for a cancel)."""
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.n += len(delta.token_ids)
        self.t_last = delta.t
        self.steps, self.draft_n, self.draft_n_accepted = (
            delta.decode_steps,
            delta.draft_n,
            delta.draft_n_accepted,
        )
        if self.t_first is None:
            self.t_first = delta.t
        now = time.monotonic()
        if self.n == len(self.token_ids) or now - self.last_flush >= self.flush_interval_s:
            self.flush(now)
            return True
        return False

    def flush(self, now: float | None = None) -> None:
        # A delta without tokens still carries text: what the engine held back (for a stop string, or an
        # unfinished character) until the end.
        if not self.token_ids and not any(self.text):
            return
        delta = {
            "text": "".join(self.text),
            "token_ids": self.token_ids,
            "n": self.n,
            "t": self.t_last,
            "t_first": self.t_first,
            "steps": self.steps,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
        }
        if self.logprobs is not None:
            delta["logprobs"] = self.logprobs
        self.publish("delta", delta)
        self.text, self.token_ids, self.logprobs = [], [], None
        self.last_flush = now or time.monotonic()


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RunningJob:
    """The job in progress, shared by the generation loop and the stall watchdog."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.progress_at = time.monotonic()  # the last sign of life: start, prefill or a token
        self.prompt_tokens: int | None = None
        self.stalled = False
        self.gone = False  # its Redis state vanished (a restart): stop, and write nothing more
        self.finished = False  # a terminal event is out: nothing more is published for this job
        self.lock = threading.Lock()


class Worker:
    def __init__(self, engines: dict, r: redis.Redis, worker_id: str | None = None):
        self.engines = engines  # public model name -> Engine
        self.worker_id = worker_id or default_worker_id()
        self.channel = WorkerChannel(r, self.worker_id, list(engines))
        self.job: RunningJob | None = None
        self.jobs_done = 0
        self.stopping = threading.Event()  # take no new job
        self.retired = threading.Event()  # the loop has ended: no heartbeat either
        # Held across a heartbeat's check of `retired` and its write, and across retiring: a beat written after
        # the retirement would list a stopped worker until the beat expires.
        self.beat_lock = threading.Lock()
        self.beat_now = threading.Event()  # a job began or ended: say so without waiting for the next beat
        self.stall_timeout_s = STALL_TIMEOUT_S
        self.stall_exit_s = STALL_EXIT_S

    @property
    def current_job(self) -> str | None:
        job = self.job
        return job.spec.id if job else None

    def info(self) -> dict:
        any_engine = next(iter(self.engines.values()))
        return {
            "device": str(any_engine.device),
            "job": self.current_job,
            "jobs_done": self.jobs_done,
            "peak_bandwidth_gbs": getattr(any_engine, "peak_bandwidth_gbs", None),
            # what a client needs to build a request: whether to send chat messages, how long a prompt fits, the
            # sampling the checkpoint recommends (its generation_config.json: the API's defaults)
            "model_info": {
                name: {
                    "chat": bool(getattr(engine.tokenizer, "has_chat_template", False)),
                    # a base model continues code: the page's placeholder is code for it, a request for a chat model
                    "base": continues_code(getattr(engine.tokenizer, "chat_template", None)),
                    "max_context": engine.max_context,
                    "sampling_defaults": getattr(engine, "sampling_defaults", {}),
                    "template_kwargs": True,  # it renders a job's template_kwargs (the web asks before sending)
                    # fill in the middle (the model's tokenizer has FIM tokens), and the jobs it takes besides
                    # plain generation, which the web asks about before sending one
                    "fim": getattr(engine, "fim", None) is not None,
                    "fim_tokens": list(engine.fim.spelling) if getattr(engine, "fim", None) else None,
                    "logprobs": hasattr(engine, "logprob_runner"),
                    "tokenize": hasattr(engine, "tokenize"),
                    # a prompt as token ids, which its tokenizer decodes (the web asks before sending one)
                    "prompt_ids": hasattr(engine, "detokenize"),
                }
                for name, engine in self.engines.items()
            },
        }

    def _heartbeat_loop(self) -> None:
        # Until serve_forever has returned, not merely until a stop was asked for: a SIGTERM (docker stop,
        # scaling down) lets the job in progress finish, and its readers must still see it alive.
        health_file = os.environ.get("KOG_HEALTH_FILE")
        while True:
            with self.beat_lock:
                if self.retired.is_set():
                    return
                try:
                    self.channel.heartbeat(self.info())
                    if health_file:
                        Path(health_file).touch()
                except redis.RedisError as exc:
                    log.warning("heartbeat failed: %s", exc)
            # Every HEARTBEAT_INTERVAL_S, and at once when a job begins or ends: the page's worker pill
            # and the readers that watch for a dropped job then see the change within a poll, not a beat.
            self.beat_now.wait(HEARTBEAT_INTERVAL_S)
            self.beat_now.clear()

    def _watchdog_loop(self) -> None:
        """End a job that produces no token for stall_timeout_s; exit if its loop never comes back."""
        tick = min(0.5, self.stall_timeout_s / 4)
        while not self.retired.wait(tick):
            job = self.job
            if job is None:
                continue
            idle = time.monotonic() - job.progress_at
            if not job.stalled and idle > self.stall_timeout_s:
                job.stalled = True  # the generation loop stops at its next token
                log.error("no token for %.1f s: ending the job", idle, extra={"job_id": job.spec.id})
                message = (
                    f"The model produced no token for {self.stall_timeout_s:g} s, so the job was ended; "
                    "please try again."
                )
                self._finish(job, "error", {"code": "stalled", "message": message})
            elif job.stalled and self.stall_exit_s > 0 and idle > self.stall_timeout_s + self.stall_exit_s:
                log.critical(
                    "the stalled job never returned: exiting for a restart", extra={"job_id": job.spec.id}
                )
                os._exit(STALL_EXIT_CODE)

    def serve_forever(self) -> None:
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        if self.stall_timeout_s > 0:
            threading.Thread(target=self._watchdog_loop, name="stall-watchdog", daemon=True).start()
        log.info("worker %s serving %s", self.worker_id, ", ".join(self.engines))
        redis_down = False
        while not self.stopping.is_set():
            try:
                spec = self.channel.next_job(timeout_s=1.0)
            except redis.RedisError as exc:
                if not redis_down:
                    log.warning("redis unavailable (%s); retrying every second", exc)
                redis_down = True
                self.stopping.wait(1.0)
                continue
            if redis_down:
                log.info("redis is back")
                redis_down = False
            if spec is not None:
                self.run_job(spec)
        with self.beat_lock:
            self.retired.set()
            with contextlib.suppress(redis.RedisError):  # else the heartbeat expires by itself
                self.channel.retire()
        self.beat_now.set()  # wakes the heartbeat loop to end

    def run_job(self, spec: JobSpec) -> None:
        job = self.job = RunningJob(spec)
        self.beat_now.set()
        out_of_memory = False
        with job_context(spec.id):
            log.info("job started", extra={"model": spec.model, "source": spec.source})
            try:
                self._run(job)
            except InvalidRequest as exc:
                self._finish(job, "error", {"code": exc.code, "param": exc.field, "message": str(exc)})
            except redis.RedisError as exc:
                # Our reads and writes failed past their retries. Say so if Redis takes the end now; if not,
                # a reader fails the job once our heartbeat stops naming it (JobClient.events).
                log.warning("lost redis during the job; dropping it: %s", exc)
                self._finish(job, "error", _queue_failed())
            except Exception as exc:  # the worker outlives any one job
                out_of_memory = is_memory_error(exc)
                if out_of_memory:
                    log.error("out of memory: %s", str(exc))  # not exc: a kept record would keep its frames
                    error = {"code": "out_of_memory", "message": out_of_memory_message(job)}
                else:
                    # The traceback stays in the log, with the job id; the client gets the id only.
                    log.exception("job failed")
                    error = {
                        "code": "internal_error",
                        "message": f"The model failed on this request (job {spec.id})",
                    }
                self._finish(job, "error", error)
            finally:
                self.job = None
                self.jobs_done += 1
                self.beat_now.set()
            log.info("job ended")
        if out_of_memory:  # out here, once the traceback holding the failed step's tensors is gone
            _release_gpu_memory()

    def _finish(self, job: RunningJob, event_type: str, data: dict) -> None:
        """Publish the job's one terminal event; the watchdog and the loop may race here."""
        with job.lock:
            if job.finished:
                return
            job.finished = True
            try:
                self.channel.finish(job.spec.id, event_type, data)
            except redis.RedisError as exc:
                log.warning("could not publish the job's end: %s", exc, extra={"job_id": job.spec.id})

    def _run(self, job: RunningJob) -> None:
        spec = job.spec
        engine = self.engines.get(spec.model)
        if engine is None:
            raise InvalidRequest(
                "model", f"unknown model {spec.model!r}; this worker serves {list(self.engines)}"
            )
        if spec.task != "generate":
            self._finish(job, "done", run_task(engine, spec))
            return
        params = spec.sampling_params()
        extra_stop_ids: frozenset[int] = frozenset()
        prompt_text = None
        if spec.prompt_ids is not None:
            # read as given, as vLLM reads them (no BOS added); their text is the echo's and the saved run's
            prompt_ids = list(spec.prompt_ids)
            prompt_text = engine.detokenize(prompt_ids, field="prompt")
        elif spec.suffix is not None:
            prompt_ids = engine.encode_fim(spec.prompt or "", spec.suffix)
            extra_stop_ids = engine.fim.stop_ids
        else:
            prompt_ids = engine.encode_prompt(
                prompt=spec.prompt,
                messages=spec.messages,
                chat=spec.chat,
                template_kwargs=spec.template_kwargs,
            )
        job.prompt_tokens = len(prompt_ids)
        if 0 < MAX_PROMPT_TOKENS < len(prompt_ids):
            raise InvalidRequest(
                "prompt", f"{len(prompt_ids)} tokens is over this server's limit of {MAX_PROMPT_TOKENS}"
            )

        def publish(kind: str, data: dict) -> None:
            if not job.finished and self.channel.publish(spec.id, kind, data) is None:
                job.gone = True  # after a stall error the late tokens go nowhere; gone, nowhere either

        coalescer = DeltaCoalescer(publish)
        cancelled = False

        def should_stop() -> bool:
            return cancelled or job.stalled or job.gone

        def asked_to_stop() -> bool:
            # A cancel, a job gone or ended elsewhere, or nobody following it past its grace (the page
            # closed, the API client or its whole web process gone): see WorkerChannel.cancelled.
            reason = self.channel.cancelled(spec.id)
            if reason == "orphaned":
                log.info("nobody follows the job any more: cancelling it")
            return bool(reason)

        job.progress_at = time.monotonic()
        # a FIM middle's own end tokens; other jobs pass nothing (an engine may not know the argument)
        stops = {"extra_stop_ids": extra_stop_ids} if extra_stop_ids else {}
        events = engine.generate(prompt_ids, params, should_stop=should_stop, **stops)
        for event in events:
            job.progress_at = time.monotonic()
            if isinstance(event, TextDelta):
                if coalescer.add(event):
                    cancelled = cancelled or asked_to_stop()
            elif isinstance(event, Prefilled):
                prefilled = asdict(event)
                if event.prompt_logprobs is None:  # only an echo with logprobs asks for them
                    del prefilled["prompt_logprobs"]
                if prompt_text is not None:
                    prefilled["prompt"] = prompt_text
                publish("prefilled", prefilled)
                cancelled = asked_to_stop()
            elif isinstance(event, Done):
                if job.finished:
                    return
                if job.gone:
                    log.warning("the job vanished from Redis (a restart?): dropped")
                    return
                coalescer.flush()
                done = asdict(event)
                done["stats"]["bandwidth_gbs"] = event.stats.bandwidth_gbs
                del done["stats"]["token_times"]  # one float per token: too heavy for the last frame, unread
                self._finish(job, "done", done)
                return
        raise RuntimeError("the engine ended without a Done event")


def run_task(engine, spec: JobSpec) -> dict:
    """A tokenize or detokenize job's result (vLLM's /tokenize and /detokenize bodies)."""
    if not hasattr(engine, "tokenize"):
        raise InvalidRequest("model", f"{spec.model!r} is a stand-in engine without a tokenizer")
    if spec.task == "detokenize":
        return {"prompt": engine.detokenize(list(spec.token_ids or []))}
    ids = engine.tokenize(spec.prompt, spec.messages, spec.add_special_tokens, spec.template_kwargs)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_context}


def _queue_failed() -> dict:
    return {"code": "unavailable", "message": "The job queue failed while this job ran; please try again."}


def out_of_memory_message(job: RunningJob) -> str:
    size = f" ({job.prompt_tokens} prompt tokens)" if job.prompt_tokens else ""
    return (
        f"The GPU ran out of memory for this request{size}; try a shorter prompt or fewer new tokens. "
        "The worker is still serving."
    )


def _release_gpu_memory() -> None:
    gc.collect()  # the failed step's frames may sit in reference cycles, holding their tensors
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort after a failure
        pass


def load_engine(model: str, device: str | None, dtype: str | None, progress=None, gpus: int = 1):
    """The engine for a MODELS / --model entry (`name=...` serves it under that name); `progress` hears a Hub
    download's (bytes done, total); `gpus` > 1: its lanes divided among that many processes
    (inference/lanes_runner.py)."""
    source = model_source(model)
    if gpus > 1:
        if source.startswith(STANDIN_PREFIX):
            raise ValueError(f"KOG_GPUS={gpus}: the stand-in engine runs on no device")
        from inference.lanes_runner import load_lanes_engine

        return load_lanes_engine(model, device=device, dtype=dtype, gpus=gpus, progress=progress)
    if source.startswith(STANDIN_PREFIX):
        engine = StandinEngine.load(source)
        engine.name = served_name(model)
        return engine
    from inference.engine import Engine  # torch loads here, not at import

    return Engine.load(model, device=device, dtype=dtype, progress=progress)


class LoadingBeat:
    """While the models load, a heartbeat that serves none and carries each Hub download's progress, so that the
    page and /v1/models show a model as "downloading 1.2 / 3.1 GB" before any worker serves it. The worker's
    own heartbeat (same id) replaces it once the models are loaded."""

    def __init__(self, r: redis.Redis, worker_id: str):
        self.channel = WorkerChannel(r, worker_id, [])
        self.downloads: dict[str, dict] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="loading-heartbeat", daemon=True)

    def progress(self, name: str):
        def report(done: int, total: int) -> None:
            self.downloads[name] = {"done": done, "total": total}

        return report

    def _loop(self) -> None:
        while True:
            with contextlib.suppress(redis.RedisError):
                self.channel.heartbeat({"loading": True, "downloads": dict(self.downloads)})
            if self.done.wait(HEARTBEAT_INTERVAL_S):
                return

    def __enter__(self) -> LoadingBeat:
        self.thread.start()
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        self.done.set()
        self.thread.join()
        if exc is not None:  # the worker ends here: no heartbeat may outlive it
            with contextlib.suppress(redis.RedisError):
                self.channel.retire()


def load_failure(exc: Exception) -> tuple[str, bool]:
    """What a failed load says in its one log line, and whether that is all (True) or a bug's traceback must go
    with it. The loaders' own errors say what is wrong, and so does the machine the worker runs on: a file it
    cannot read (OSError), an allocation it refuses or a CUDA error (a LoadOutOfMemory already says what did
    not fit). Any other RuntimeError (a shape mismatch, NotImplementedError, RecursionError) is a bug."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    if type(exc).__module__.startswith(("inference.", "common.")) or isinstance(exc, ValueError | OSError):
        return text, True
    if is_memory_error(exc) or is_device_error(exc):
        return (f"{type(exc).__name__}: {text}" if lines else text), True
    return text, False


def _setting(flag_value: str | None, variable: str, choices: tuple[str, ...]) -> str | None:
    """A --flag's value (argparse checked it), else the environment variable's, which argparse does not check."""
    if flag_value is not None:
        return flag_value
    value = os.environ.get(variable, "").strip()
    if value and not is_choice(value, choices):
        raise EnvError(f"{variable}: must be one of {', '.join(choices)}, got {value!r}")
    return value or None


def is_choice(value: str, choices: tuple[str, ...]) -> bool:
    """`value` is one of `choices`, where a choice ending in ":N" stands for any index (cuda:0, cuda:1, ...)."""
    return any(
        value == choice or (choice.endswith(":N") and re.fullmatch(re.escape(choice[:-1]) + r"\d+", value))
        for choice in choices
    )


def positive_int(value: str) -> int:
    """--gpus: an integer >= 1."""
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return int(value)


def device_name(value: str) -> str:
    """--device's type: one of DEVICES (argparse's choices cannot take cuda:N)."""
    if not is_choice(value, DEVICES):
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DEVICES)}, got {value!r}")
    return value


def reach_redis(url: str, given_as: str | None) -> redis.Redis:
    """A client for `url` (`given_as`: the flag or variable that gave it; None: the default), once Redis
    answers: before any model loads, so that a wrong URL or an unreachable server ends the worker in seconds,
    not after minutes of loading. SystemExit with one logged line if not."""
    shown = f"{given_as}={redacted_url(url)}" if given_as else f"{url} (REDIS_URL is unset: the default)"
    try:
        client = connect(url)
    except ValueError as exc:  # no redis://, rediss:// or unix:// scheme, a port that is no number, ...
        log.error("%s is not a Redis URL (%s); e.g. %s", shown, url_problem(url, exc), DEFAULT_REDIS_URL)
        raise SystemExit(USAGE_EXIT_CODE) from None
    try:
        client.ping()
    except redis.RedisError as exc:
        log.error("cannot reach Redis at %s: %s", shown, exc)
        raise SystemExit(REDIS_EXIT_CODE) from None
    return client


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m inference.worker", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        help="checkpoint dir or synthetic preset, NAME=... to serve it as NAME (repeatable)",
    )
    parser.add_argument("--redis-url", help=f"default: $REDIS_URL, else {DEFAULT_REDIS_URL}")
    parser.add_argument(
        "--device",
        type=device_name,
        metavar="{" + ",".join(DEVICES) + "}",
        help="default: $KOG_DEVICE, else cuda when there is a GPU",
    )
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help="default: $KOG_DTYPE, else bfloat16 on cuda")
    parser.add_argument(
        "--gpus",
        type=positive_int,
        help="processes (GPUs) one Laneformer's lanes are divided among; default: $KOG_GPUS, else 1",
    )
    parser.add_argument("--worker-id", default=os.environ.get("WORKER_ID"))
    args = parser.parse_args(argv)
    try:
        configure_logging()
    except ValueError as exc:  # LOG_FORMAT, LOG_LEVEL
        parser.exit(USAGE_EXIT_CODE, f"{parser.prog}: error: {exc}\n")

    # Everything that can be checked without loading is, first: a mistake ends it in a second, in one line.
    try:
        read_settings()
        env_max_context()  # read again by Engine.load
        env_prefix_slots()  # and this one by the engine's prefix cache
        SpeculationSettings.from_env()  # KOG_SPECULATIVE, KOG_DRAFT_MAX: read again by each runner
        _setting(None, "KOG_BACKEND", BACKENDS)
        device = _setting(args.device, "KOG_DEVICE", DEVICES)
        dtype = _setting(args.dtype, "KOG_DTYPE", DTYPE_NAMES)
        models = list(served_names(configured_models(args.model)).values())
        gpus = args.gpus or int(env_number("KOG_GPUS", 1, "an integer >= 1", integer=True, minimum=1))
        if gpus > 1 and len(models) > 1:
            raise EnvError(f"KOG_GPUS={gpus}: a worker on several GPUs serves one model, got {len(models)}")
    except (EnvError, ModelNameError) as exc:
        log.error("%s", exc)
        raise SystemExit(USAGE_EXIT_CODE) from None
    if args.redis_url:
        r = reach_redis(args.redis_url, "--redis-url")
    elif os.environ.get("REDIS_URL", "").strip():
        r = reach_redis(os.environ["REDIS_URL"].strip(), "REDIS_URL")
    else:
        r = reach_redis(DEFAULT_REDIS_URL, None)

    engines = {}
    worker_id = args.worker_id or default_worker_id()
    with LoadingBeat(r, worker_id) as loading:
        for model in models:
            try:
                engine = load_engine(
                    model,
                    device=device,
                    dtype=dtype,
                    progress=loading.progress(served_name(model)),
                    gpus=gpus,
                )
            except Exception as exc:
                # One line that says what is wrong, no traceback, where the cause is the checkpoint or the machine;
                # anything else is a bug, and its traceback goes with it.
                text, known = load_failure(exc)
                log.error("cannot load model %s: %s", model, text, exc_info=not known)
                raise SystemExit(LOAD_EXIT_CODE) from None
            engines[engine.name] = engine
            log.info(
                "loaded %s on %s%s",
                engine.name,
                engine.device,
                f" and {gpus - 1} more ranks" if gpus > 1 else "",
            )
    worker = Worker(engines, r, worker_id)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stopping.set())
    worker.serve_forever()


if __name__ == "__main__":
    main()
