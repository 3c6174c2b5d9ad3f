"""The page's websocket at /ws/generate/: submit a job, stream it, stop it, resume it after a reconnect.

Frames are JSON objects with a "type". The consumer only awaits Redis; the model runs in a worker.

Client -> server
    {"type": "generate", "prompt": str, "model": str, "system_prompt": str,
     "temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int,
     "repetition_penalty": float,
     "history": [{"prompt": str, "answer": str}]}   everything but prompt is optional; history: the earlier
                                                    turns of a conversation with a chat model, oldest first
    {"type": "stop"}                                stop the job this socket follows; its partial text is kept
    {"type": "resume", "job_id": str, "after": str} follow a job again after a reconnect, from the entry
                                                    after `after` (the last "id" the client applied)

Server -> client. Job frames carry "job_id" and "id", the Redis stream entry id ("" for queue frames,
which are not stream entries): a client that applies each id once, in order, never shows a gap or
a duplicate, whatever reconnects happen.
    {"type": "workers", "up": bool, "count": int, "busy": int, "devices": [str],
     "models": [{"name", "chat", "max_context", "workers"}]}       on connect, then on every change
    {"type": "queue", "position": int | null, "workers": int, "wait_s": float | null}
        jobs ahead; workers serving the model; about how long until it starts (the model's average job
        length, measured; null before one was)
    {"type": "started", "worker": str, "queue_ms": float}
    {"type": "prefilled", "prompt_tokens": int, "prefill_ms": float, "cached_tokens": int}
    {"type": "delta", "text": str, "n": int, "t": float, "t_first": float,
     "steps": int, "draft_n": int, "draft_n_accepted": int}
        n tokens so far; t and t_first are the worker's clock (s) at the last and first token, so
        decode tokens/s = (n - 1) / (t - t_first) whenever the bytes arrive; steps: the model steps after
        the first token (tokens per step = (n - 1) / steps); draft_n, draft_n_accepted: speculative
        decoding's drafted and accepted tokens so far
    {"type": "done", "finish_reason": "stop" | "length" | "cancelled", "text": str,
     "stats": {...} | null, "share_url": str | null}
        stats: the worker's (prompt and completion tokens, prefill_ms, ttft_ms, decode_tok_s, total_ms, ...)
        plus queue_ms, the wait for a worker, which the worker's clock (ttft_ms included) leaves out
    {"type": "error", "code": str, "message": str, "param": str?}
        codes: bad_frame, frame_too_large, invalid_request (with param), busy, queue_full,
        rate_limited (with retry_after_s), unknown_job, unavailable, internal_error, and those of
        the job protocol and the worker (worker_lost, queue_restarted, stalled, out_of_memory, ...)
A bad frame gets an error frame and the socket stays open. Limits for a public demo: frames of at
most PLAYGROUND_MAX_FRAME_BYTES, one generation at a time per socket, requests and generated
tokens per minute per client IP (playground/limits.py), a bounded queue, sampling values clamped
to their ranges (playground/jobs.py). If Redis goes away mid-run, the socket waits up to
PLAYGROUND_REDIS_RETRY_S for it and then tells the client what became of the job.

A job outlives its socket so that a reconnect can resume it. Every socket following a job holds a
lease on it in Redis (playground.jobs.Lease), renewed every second; when no lease has been live for
PLAYGROUND_ORPHAN_GRACE_S (the page closed and no reload resumed it, or the web process died, SIGKILL
included), the job's worker cancels it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re

import redis
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from common.events import InvalidRequest
from common.logs import job_context
from common.protocol import JobClient, JobSpec, QueueFull, VisitorBusy
from playground import limits, metrics
from playground.jobs import (
    Lease,
    job_client,
    recent_workers,
    redis_back,
    served_models,
    spec_from_frame,
    worker_summary,
)
from playground.store import save_generation

log = logging.getLogger("playground.consumers")

ENTRY_ID = re.compile(r"\d+(-\d+)?")
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What a delta frame passes on from the worker's entry (a worker without speculation counters sends 0s).
DELTA_KEYS = ("text", "n", "t", "t_first", "steps", "draft_n", "draft_n_accepted")
_orphan_checks: set[asyncio.Task] = set()  # strong references, so pending checks are not collected
# This process's open sockets per address (rate_identity): PLAYGROUND_MAX_SOCKETS_PER_IP
_open_sockets: collections.Counter[str] = collections.Counter()


class GenerateConsumer(AsyncWebsocketConsumer):
    # Jobs travel through their Redis streams, not a channel layer (settings configure none): a layer
    # subscription would only be one more Redis connection whose loss (a Redis restart) kills the socket.
    spec: JobSpec | None = None  # the job this socket follows
    lease: Lease | None = None  # this socket's lease on that job
    follower: asyncio.Task | None = None  # streams that job's events to the socket
    status_task: asyncio.Task | None = None  # sends worker status changes

    async def connect(self):
        self.jobs: JobClient = job_client()
        self.client_ip = limits.ip_from_scope(self.scope, limits.configured().trusted_proxies)
        self.address = limits.rate_identity(self.client_ip)
        await self.accept()
        cap = settings.PLAYGROUND_MAX_SOCKETS_PER_IP
        if cap and _open_sockets[self.address] >= cap:
            await self.send_error("too_many_sockets", f"at most {cap} open pages per address; close one")
            return await self.close(code=4008)  # autobahn takes 1000 or 3000-4999 from an application
        _open_sockets[self.address] += 1
        self.counted = True
        self.status_task = asyncio.create_task(self.watch_workers())

    async def disconnect(self, code):
        if getattr(self, "counted", False):
            self.counted = False
            _open_sockets[self.address] -= 1
            if _open_sockets[self.address] <= 0:
                del _open_sockets[self.address]
        if self.status_task is not None:
            self.status_task.cancel()
        if self.following():
            self.follower.cancel()
            await self.detach()

    async def receive(self, text_data=None, bytes_data=None):
        if not getattr(self, "counted", False):
            return  # a socket over the address's cap, being closed: what it sent is dropped, the page sends again
        limit = settings.PLAYGROUND_MAX_FRAME_BYTES
        size = len(bytes_data) if text_data is None else len(text_data.encode("utf-8", "surrogatepass"))
        if size > limit:  # checked before parsing: a huge frame costs no JSON work
            return await self.send_error("frame_too_large", f"frames must be at most {limit // 1024} KiB")
        try:
            frame = json.loads(text_data) if text_data is not None else None
        except ValueError:
            frame = None
        except RecursionError:  # json's decoder recurses once per [ or {: a bad frame, not a bug of ours
            return await self.send_error("bad_frame", "frames must be JSON objects nested a few levels deep")
        if not isinstance(frame, dict):
            return await self.send_error("bad_frame", "frames must be JSON objects with a type")
        kind = frame.get("type")
        handlers = {"generate": self.generate, "stop": self.stop, "resume": self.resume}
        handler = handlers.get(kind) if isinstance(kind, str) else None
        if handler is None:
            return await self.send_error(
                "bad_frame", f"type: must be generate, stop or resume, got {kind!r:.80}"
            )
        try:
            await handler(frame)
        except InvalidRequest as exc:
            await self.send_error("invalid_request", str(exc), param=exc.field)
        except QueueFull as exc:
            await self.send_error("queue_full", str(exc))
        except VisitorBusy as exc:
            await self.send_error("too_many_jobs", str(exc))
        except redis.RedisError as exc:
            log.warning("redis unavailable: %s", exc)
            await self.send_error("unavailable", "the job queue is unreachable; try again shortly")

    # ---- client frames ----------------------------------------------------------------------------

    async def generate(self, frame: dict) -> None:
        if self.following():
            return await self.send_error("busy", "a generation is running on this connection; stop it first")
        models = served_models(await self.jobs.workers())
        spec = spec_from_frame(frame, models)
        verdict = await limits.limiter().admit(self.client_ip)
        if not verdict.allowed:
            return await self.send_error("rate_limited", verdict.message, retry_after_s=verdict.retry_after_s)
        lease = Lease(self.jobs, spec.id)
        try:  # the job's first lease is this socket's, taken with the job: no worker sees it unfollowed
            await self.jobs.submit(
                spec,
                follower=lease.follower,
                grace_s=settings.PLAYGROUND_ORPHAN_GRACE_S,
                visitor=limits.visitor(self.client_ip),
            )
        except (QueueFull, VisitorBusy):
            await limits.limiter().refund(verdict)  # turned away: the request does not count
            raise
        self.attach(spec, lease)
        position = await self.jobs.position(spec.id, spec.model)
        workers = models[spec.model]["workers"]
        wait_s = await self.jobs.estimated_wait_s(spec.model, position, workers)
        await self.send_frame(
            spec.id, "", "queue", {"position": position, "workers": workers, "wait_s": wait_s}
        )
        self.follow(after="0-0")

    async def stop(self, frame: dict) -> None:
        # Stopping a job that has just ended is not an error: the click and the end crossed paths.
        if self.following():
            await self.jobs.cancel(self.spec.id)

    async def resume(self, frame: dict) -> None:
        job_id, after = frame.get("job_id"), frame.get("after") or "0-0"
        if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
            raise InvalidRequest("job_id", "must be the job_id of an earlier queue frame")
        if not isinstance(after, str) or not ENTRY_ID.fullmatch(after):
            raise InvalidRequest("after", "must be a stream entry id such as 1700000000000-0")
        if self.following():
            return await self.send_error("busy", "a generation is running on this connection; stop it first")
        verdict = await limits.limiter().admit(self.client_ip)  # a resume is a request like any other
        if not verdict.allowed:
            return await self.send_error("rate_limited", verdict.message, retry_after_s=verdict.retry_after_s)
        job = await self.jobs.status(job_id)
        if "spec" not in job:  # none, or a late status write that outlived an expired job's record
            return await self.send_error("unknown_job", f"job_id: no job {job_id}; finished jobs expire")
        lease = Lease(self.jobs, job_id)
        await lease.take()  # False for a job that has ended: it is replayed, with nothing to hold
        self.attach(JobSpec.from_json(job["spec"]), lease)
        self.follow(after=after)

    # ---- following a job --------------------------------------------------------------------------

    def following(self) -> bool:
        return self.follower is not None and not self.follower.done()

    def follow(self, after: str) -> None:
        self.follower = asyncio.create_task(self.stream(self.spec, after))

    async def stream(self, spec: JobSpec, after: str) -> None:
        with job_context(spec.id):
            try:
                await self._stream(spec, after)
            except Exception:  # a bug here must not leave the page waiting forever
                log.exception("streaming failed")
                await self.send_error("internal_error", "the server failed while streaming", job_id=spec.id)
            finally:
                self.lease.stop()  # the job has ended (or this socket gave up on it): nothing to hold

    async def _stream(self, spec: JobSpec, after: str) -> None:
        queue_ms = None
        while True:
            try:
                # known: this socket submitted the job or read its record, so a job missing after a Redis
                # restart was lost to it (queue_restarted), even one still queued, with no event yet
                async for entry_id, kind, data in self.jobs.events(spec.id, after=after, known=True):
                    if entry_id:
                        after = entry_id
                    if kind == "started":
                        queue_ms = data.get("queue_ms")
                    elif kind == "delta":
                        data = {key: data.get(key, 0) for key in DELTA_KEYS}  # token ids stay home
                    elif kind == "prefilled":
                        data = {
                            key: data.get(key, 0) for key in ("prompt_tokens", "prefill_ms", "cached_tokens")
                        }
                    elif kind in ("done", "error"):
                        await metrics.observe_finished(
                            self.jobs.r, spec.id, spec.model, spec.source, kind, data, queue_ms
                        )
                        if kind == "done":
                            data = await self.finished(spec, data, queue_ms)
                    await self.send_frame(spec.id, entry_id, kind, data)
                return
            except redis.RedisError as exc:
                # Lost Redis: wait for it (it may be restarting), then carry on from the last entry
                # sent; a job that did not survive the restart is reported by the protocol.
                log.warning("lost redis while streaming: %s", exc)
                deadline = asyncio.get_running_loop().time() + settings.PLAYGROUND_REDIS_RETRY_S
                if not await redis_back(self.jobs, deadline):
                    # Nothing to resume: the job's state was out of reach, and its worker stops a job that
                    # nobody follows, so the page must run it again. (send_error counts the error.)
                    message = "the job queue was unreachable; run it again"
                    return await self.send_error("unavailable", message, job_id=spec.id)

    async def finished(self, spec: JobSpec, done: dict, queue_ms: float | None) -> dict:
        stats = done.get("stats")
        if stats:
            stats = {key: value for key, value in stats.items() if key != "token_times"}
            queue_ms = queue_ms if queue_ms is not None else await queue_wait_ms(self.jobs, spec.id)
            if queue_ms is not None:
                stats["queue_ms"] = queue_ms
        share_url = None
        if stats:
            try:
                await limits.limiter().charge_tokens(
                    self.client_ip, None, stats["completion_tokens"], spec.id
                )
            except redis.RedisError as exc:  # the run is over either way; the budget misses one charge
                log.warning("could not charge the tokens of %s: %s", spec.id, exc)
        if done.get("stats") is not None:  # a job cancelled before it started has nothing to share
            try:
                share_url = (await save_generation(spec, done)).get_absolute_url()
            except Exception:  # the run itself succeeded: show it even if the database is down
                log.exception("could not save generation %s", spec.id)
        return {
            "finish_reason": done["finish_reason"],
            "text": done["text"],
            "stats": stats,
            "share_url": share_url,
        }

    def attach(self, spec: JobSpec, lease: Lease) -> None:
        """Follow `spec`'s job, holding `lease` (taken already) for as long as this socket follows it."""
        self.spec, self.lease = spec, lease
        lease.keep()

    async def detach(self) -> None:
        """The socket closed while following its job: let the lease lapse now, so that the job's grace for
        a reload starts here, and see to the job once the grace is over."""
        await self.lease.release()
        task = asyncio.create_task(cancel_if_orphaned(self.jobs, self.spec, self.client_ip))
        _orphan_checks.add(task)
        task.add_done_callback(_orphan_checks.discard)

    # ---- worker status ----------------------------------------------------------------------------

    async def watch_workers(self) -> None:
        last = None
        while True:
            try:
                interval = settings.PLAYGROUND_STATUS_INTERVAL_S
                summary = worker_summary(await recent_workers(self.jobs, max_age_s=interval / 2))
            except redis.RedisError:
                summary = {**worker_summary([]), "error": "the job queue is unreachable"}
            if summary != last:
                await self.send(text_data=json.dumps({"type": "workers", **summary}))
                last = summary
            await asyncio.sleep(settings.PLAYGROUND_STATUS_INTERVAL_S)

    # ---- sending ----------------------------------------------------------------------------------

    async def send_frame(self, job_id: str, entry_id: str, kind: str, data: dict) -> None:
        await self.send(text_data=json.dumps({"type": kind, "job_id": job_id, "id": entry_id, **data}))

    async def send_error(self, code: str, message: str, **extra) -> None:
        metrics.count_error(code)
        await self.send(text_data=json.dumps({"type": "error", "code": code, "message": message, **extra}))


async def queue_wait_ms(jobs: JobClient, job_id: str) -> float | None:
    """The job's wait for a worker, from its record: for a reader that did not see its `started` event."""
    try:
        job = await jobs.status(job_id)
        return (float(job["started"]) - float(job["created"])) * 1000
    except (KeyError, ValueError, redis.RedisError):
        return None  # the run is over either way: its stats go without it


async def cancel_if_orphaned(jobs: JobClient, spec: JobSpec, client_ip: str) -> None:
    """After a page closed: unless a client resumed the job within the grace period, cancel it (its worker
    would, at its next flush, but a queued job leaves the queue only this way), count it and charge its tokens.
    A web process that dies never gets here: then the worker alone ends the job."""
    await asyncio.sleep(settings.PLAYGROUND_ORPHAN_GRACE_S)
    try:
        if await jobs.followed(spec.id):
            return  # the socket that resumed it counts and charges it when it ends
        if (await jobs.status(spec.id)).get("status") in ("queued", "running"):
            log.info("cancelling %s: its page closed", spec.id)
            await jobs.cancel(spec.id)
        await see_it_end(jobs, spec, client_ip)
    except redis.RedisError as exc:
        log.warning("orphan check for %s failed: %s", spec.id, exc)


async def see_it_end(jobs: JobClient, spec: JobSpec, client_ip: str) -> None:
    """Count in the metrics and charge the tokens of a job no socket saw end: the worker's work counts, and a
    page that closes right after asking must not generate outside its client's token budget."""
    kind, data = await jobs.outcome(spec.id, known=True)
    if kind == "done" and data.get("stats"):  # first: the budget matters more than a metric
        tokens = data["stats"]["completion_tokens"]
        await limits.limiter().charge_tokens(client_ip, None, tokens, spec.id)
    queue_ms = await queue_wait_ms(jobs, spec.id)
    await metrics.observe_finished(jobs.r, spec.id, spec.model, spec.source, kind, data, queue_ms)
