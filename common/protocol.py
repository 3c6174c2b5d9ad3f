"""The Redis job protocol that joins web processes and inference workers.

Torch-free: the web process imports it. Keys (all under `PREFIX`):

    queue:<model>     list of job ids in the order they are served, BLPOP by a worker serving <model>. The web
                      places a job by its visitor's turn (round robin across visitors, not first come first
                      served): a job's `round` is one past its visitor's last (turns:<model>) and never
                      before the round now served (round:<model>, set by the claim); it goes after every
                      job of its round or an earlier one. A job with no visitor (a probe) takes the
                      current round.
    turns:<model>     hash: visitor -> the round of the last job it queued
    round:<model>     the round of the job a worker claimed last
    moved:<model>     stream of ticks (capped), one each time the queue's order changes other than at its tail (a
                      claim, a cancel, a job placed ahead of others): the followers of queued jobs block on it
                      beside their job's events instead of polling for their position
    speed:<model>     hash: tok_s and job_s, moving averages of the finished jobs' decode speed and length
                      (start to end): the page's estimated wait, the per-address token budget's size
    visitor:<v>       set of a visitor's job ids (an address or an API key): at most `max_per_visitor`
                      of them queued or running at once; the ended ones are dropped as it is counted
    job:<id>          hash: spec (json), model, status, worker, created/started/finished (unix s)
    events:<id>       stream of {type, data(json)}: started, prefilled, delta, done, error.
                      Readers resume from the last entry id they saw, so a reconnect loses nothing
                      and repeats nothing.
    cancel:<id>       set by whoever wants the job stopped; the worker looks at each flush
    followers:<id>    sorted set: follower id -> when its lease lapses (Redis' clock, unix s). Every
                      follower of a job (a page's socket, an API request) refreshes its lease every
                      LEASE_INTERVAL_S; the web that submits the job takes the first lease in the
                      same step. A job submitted with a lease has a `grace` in its hash: once no
                      lease has been live for that long, the job is orphaned and its worker ends it
                      as cancelled (at its next flush, or instead of starting it). A job submitted
                      without one (a probe, a script) is never orphaned.
    worker:<wid>      heartbeat (json: models, device, job, ...) that expires after HEARTBEAT_TTL_S
    workers           sorted set: worker id -> time of its last heartbeat, so that listing the live
                      workers (ids whose heartbeat key is still there) is one script however many
                      keys Redis holds (no SCAN)

Job status goes queued -> running -> done | error | cancelled. A job is never lost silently: a
reader that finds its job's worker gone (heartbeat expired) writes the error event itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, fields

from common.events import SamplingParams

log = logging.getLogger("common.protocol")

PREFIX = os.environ.get("KOG_REDIS_PREFIX", "kog:")
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 3.0
EVENTS_TTL_S = 3600  # finished streams stay readable for an hour (share links read the database)
POOL_WAIT_S = 20.0  # how long a command waits for a free pooled connection before failing
LOST_CLAIM_S = 5.0  # a job popped from the queue but never claimed for this long is reported lost
# A running job its worker's heartbeat stops naming (the worker dropped it, or a namesake restarted) is
# reported lost after this long: a claim reaches the heartbeat within HEARTBEAT_INTERVAL_S.
DROPPED_JOB_S = HEARTBEAT_TTL_S + HEARTBEAT_INTERVAL_S
NO_WORKER_WAIT_S = 60.0  # a queued job whose model no live worker serves for this long is turned away
# A follower refreshes its lease this often, and a lease not refreshed for LEASE_TTL_S has lapsed: a web
# process that dies (SIGKILL included) leaves its jobs unfollowed within LEASE_TTL_S.
LEASE_INTERVAL_S = 1.0
LEASE_TTL_S = 4.0
# A follower of a queued job blocks this long on its events and the queue's ticks before it looks at the
# job itself (workers come and go, a pop never claimed): a queued job's followers cost Redis about a
# command a second between ticks, however many there are.
QUEUED_BLOCK_MS = 4000
MOVED_MAXLEN = 64  # ticks kept per model: a follower only needs to know that one came
SPEED_WEIGHT = 0.2  # a finished job's weight in its model's moving averages (speed:<model>)

TERMINAL = ("done", "error")
# A worker whose generation loop a job stalled exits with this status, for its supervisor (playground/run.py,
# a container's restart policy) to start it again.
STALL_EXIT_CODE = 75  # EX_TEMPFAIL: "restart me"


def queue_key(model: str) -> str:
    return f"{PREFIX}queue:{model}"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{PREFIX}events:{job_id}"


def cancel_key(job_id: str) -> str:
    return f"{PREFIX}cancel:{job_id}"


def followers_key(job_id: str) -> str:
    return f"{PREFIX}followers:{job_id}"


def turns_key(model: str) -> str:
    return f"{PREFIX}turns:{model}"


def round_key(model: str) -> str:
    return f"{PREFIX}round:{model}"


def moved_key(model: str) -> str:
    return f"{PREFIX}moved:{model}"


def speed_key(model: str) -> str:
    return f"{PREFIX}speed:{model}"


def visitor_key(visitor: str) -> str:
    return f"{PREFIX}visitor:{visitor}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def workers_key() -> str:
    return f"{PREFIX}workers"


def connect(
    url: str, use_asyncio: bool = False, max_connections: int = 100, socket_timeout: float | None = 10
):
    """A Redis client that rides out a Redis restart: a command that meets a dropped connection is
    retried on a new one with backoff (about 1.5 s in all), and a dead peer is noticed (keepalive,
    timeouts) instead of hanging. Longer outages surface as redis.ConnectionError to the caller.

    Every blocking read (a websocket following its job) holds a connection while it waits, so the
    pool is a blocking one: past `max_connections` a command waits for a free connection (up to
    POOL_WAIT_S) instead of failing with "Too many connections".
    """
    if use_asyncio:
        import redis.asyncio as client_module
        from redis.asyncio.retry import Retry
    else:
        import redis as client_module
        from redis.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError

    pool = client_module.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=POOL_WAIT_S,
        decode_responses=True,
        socket_connect_timeout=2,
        socket_timeout=socket_timeout,  # above the blocking reads' own timeouts (BLPOP 1 s, XREAD 250 ms)
        socket_keepalive=True,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5),
        retry_on_error=[ConnectionError, TimeoutError],
    )
    return client_module.Redis(connection_pool=pool)


class QueueFull(Exception):
    """The model's queue holds `max_queue` jobs already."""


class VisitorBusy(Exception):
    """The visitor has `max_per_visitor` jobs queued or running already."""


@dataclass
class JobSpec:
    model: str
    prompt: str | None = None
    # the prompt as token ids, read as given (no BOS added, as vLLM reads them); the worker decodes them for the
    # prompt's text (an echo, the saved run)
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None  # chat: [{"role": ..., "content": ...}]
    chat: bool = False  # render `prompt` (or `messages`) through the model's chat template
    template_kwargs: dict | None = (
        None  # the chat template's further variables (the API's chat_template_kwargs)
    )
    params: dict = field(default_factory=dict)  # SamplingParams fields
    # fill in the middle: `prompt` is the code before the cursor, this the code after it (inference/fim.py)
    suffix: str | None = None
    # generate, or one of TASKS: the worker answers at once with a `done` event holding the result
    task: str = "generate"
    token_ids: list[int] | None = None  # detokenize's input
    add_special_tokens: bool = True  # tokenize: the BOS a prompt gets (vLLM's flag)
    source: str = "web"  # web | api: for metrics and logs
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)

    def sampling_params(self) -> SamplingParams:
        params = dict(self.params)
        for name in ("stop", "stop_token_ids"):  # lists in JSON
            if name in params:
                params[name] = tuple(params[name] or ())
        return SamplingParams(**params)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """Raises ValueError for what no web process writes. Fields unknown here are left out, so that a
        newer web process can add one without stopping older workers."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a job spec is a JSON object")
        spec = cls(**{name: value for name, value in data.items() if name in _SPEC_FIELDS})
        if not isinstance(spec.model, str) or not isinstance(spec.id, str):
            raise ValueError("model and id must be strings")
        if isinstance(spec.created, bool) or not isinstance(spec.created, int | float):
            raise ValueError(f"created must be a number (unix seconds), got {spec.created!r}")
        if not isinstance(spec.params, dict):
            raise ValueError("params must be an object")
        if spec.template_kwargs is not None and not isinstance(spec.template_kwargs, dict):
            raise ValueError("template_kwargs must be an object")
        if spec.task not in ("generate", *TASKS):
            raise ValueError(f"task must be generate or one of {', '.join(TASKS)}, got {spec.task!r}")
        if spec.suffix is not None and not isinstance(spec.suffix, str):
            raise ValueError("suffix must be a string")
        ids = spec.prompt_ids
        if ids is not None and not (
            isinstance(ids, list) and 0 < len(ids) <= MAX_PROMPT_IDS and all(map(is_token_id, ids))
        ):
            raise ValueError(f"prompt_ids must be a list of 1 to {MAX_PROMPT_IDS:,} integers >= 0")
        return spec


def is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0  # JSON's true is no id


# A job's prompt_ids at most: past any context served here, and a bound on the spec a worker reads from Redis
MAX_PROMPT_IDS = 1 << 20
# Jobs that run no generation: a tokenizer's answer, which the web cannot give itself (it has no tokenizer)
TASKS = ("tokenize", "detokenize")


_SPEC_FIELDS = frozenset(spec_field.name for spec_field in fields(JobSpec))


def _entry(event_type: str, data: dict) -> dict:
    return {"type": event_type, "data": json.dumps(data)}


# Lua that the scripts looking at leases start with: the time is Redis' own (no host's clock is compared
# with another's), and a job is orphaned when it has a grace (it was submitted with a lease) and its
# last lease lapsed longer ago than that grace (a missing followers set counts as lapsed long ago).
_LEASE_LUA = """
local function now()
    local t = redis.call('TIME')
    return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function orphaned(job, followers)
    local grace = redis.call('HGET', job, 'grace')
    if not grace then return false end
    local last = redis.call('ZREVRANGE', followers, 0, 0, 'WITHSCORES')
    return now() > tonumber(last[2] or 0) + tonumber(grace)
end
-- The queue of `model` changed order: a tick on its moved stream (`prefix`: the moved streams' key prefix).
local function tick(prefix, model)
    redis.call('XADD', prefix .. model, 'MAXLEN', '~', 64, '*', 'moved', '1')  -- MOVED_MAXLEN
end
-- A job that never started, ended as cancelled: its `done` event (data: json), its status, its leases gone.
local function end_unstarted(job, followers, events, finished, data, ttl)
    redis.call('XADD', events, '*', 'type', 'done', 'data', data)
    redis.call('HSET', job, 'status', 'cancelled', 'finished', finished)
    redis.call('EXPIRE', events, ttl)
    redis.call('EXPIRE', job, ttl)
    redis.call('DEL', followers)
end
"""


# ---- the worker's side (sync redis client) -----------------------------------------------------


class WorkerChannel:
    """What a worker does to Redis. `r` is a sync `redis.Redis(decode_responses=True)`."""

    # A job's events are written only while its hash exists and has no end: after a Redis restart that
    # lost the job, or once a reader has ended it (its worker looked lost), the worker learns so from its
    # next write instead of re-creating a stream nobody reads or writing past the end.
    # KEYS: events, job. ARGV: type, data.
    _PUBLISH = """
    if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('HEXISTS', KEYS[2], 'finished') == 1 then
        return false
    end
    return redis.call('XADD', KEYS[1], '*', 'type', ARGV[1], 'data', ARGV[2])
    """
    # The same for the terminal event, which also marks the job and drops its leases (KEYS: events, job,
    # followers); ARGV: type, data, status, now, ttl.
    _FINISH = """
    if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('HEXISTS', KEYS[2], 'finished') == 1 then
        return 0
    end
    redis.call('XADD', KEYS[1], '*', 'type', ARGV[1], 'data', ARGV[2])
    redis.call('HSET', KEYS[2], 'status', ARGV[3], 'finished', ARGV[4])
    redis.call('EXPIRE', KEYS[1], ARGV[5])
    redis.call('EXPIRE', KEYS[2], ARGV[5])
    redis.call('DEL', KEYS[3])
    return 1
    """

    # A popped job is claimed only while it is still queued: a reader may have failed it as lost, or
    # a cancel ended it, between the pop and the claim. One nobody has followed for longer than its grace
    # (its web process died, its page closed) is ended as cancelled instead of started.
    # KEYS: job, followers, events; ARGV: worker id, now, the cancelled end's data, ttl.
    # Returns {'claimed', spec}, {'orphaned'}, or false.
    _CLAIM = """
    if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return false end
    if orphaned(KEYS[1], KEYS[2]) then
        end_unstarted(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3], ARGV[4])
        return {'orphaned'}
    end
    redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'started', ARGV[2])
    local model, round = redis.call('HGET', KEYS[1], 'model'), redis.call('HGET', KEYS[1], 'round')
    if round then redis.call('SET', ARGV[5] .. model, round, 'EX', ARGV[4] * 24) end
    tick(ARGV[6], model)
    return {'claimed', redis.call('HGET', KEYS[1], 'spec')}
    """

    # Why the job in progress should stop, or false: KEYS: cancel, job, followers.
    _CANCELLED = """
    if redis.call('EXISTS', KEYS[1]) == 1 then return 'cancel' end
    if redis.call('EXISTS', KEYS[2]) == 0 then return 'gone' end
    if redis.call('HEXISTS', KEYS[2], 'finished') == 1 then return 'ended' end
    if orphaned(KEYS[2], KEYS[3]) then return 'orphaned' end
    return false
    """

    def __init__(self, r, worker_id: str, models: list[str]):
        self.r = r
        self.worker_id = worker_id
        self.models = models
        self._claim = r.register_script(_LEASE_LUA + self._CLAIM)
        self._publish = r.register_script(self._PUBLISH)
        self._finish = r.register_script(self._FINISH)
        self._cancelled = r.register_script(_LEASE_LUA + self._CANCELLED)

    def heartbeat(self, info: dict) -> None:
        now = time.time()
        payload = {"id": self.worker_id, "models": self.models, "time": now, **info}
        pipe = self.r.pipeline()
        pipe.set(worker_key(self.worker_id), json.dumps(payload), px=int(HEARTBEAT_TTL_S * 1000))
        pipe.zadd(workers_key(), {self.worker_id: now})
        pipe.execute()

    def retire(self) -> None:
        pipe = self.r.pipeline()
        pipe.delete(worker_key(self.worker_id))
        pipe.zrem(workers_key(), self.worker_id)
        pipe.execute()

    def next_job(self, timeout_s: float = 1.0) -> JobSpec | None:
        """Block for the next job of any served model; claim it (status running) before returning."""
        popped = self.r.blpop([queue_key(m) for m in self.models], timeout=timeout_s)
        return None if popped is None else self.claim(popped[1])

    def claim(self, job_id: str) -> JobSpec | None:
        """Mark a popped job running on this worker and announce it; None when it is no longer queued, or
        when nobody has followed it for longer than its grace (it is then ended as cancelled)."""
        now = time.time()
        keys = [job_key(job_id), followers_key(job_id), events_key(job_id)]
        args = [self.worker_id, now, json.dumps(_cancelled_before_start()), EVENTS_TTL_S, round_key("")]
        args.append(moved_key(""))
        claimed = self._claim(keys=keys, args=args)
        if not claimed:  # expired, deleted, cancelled or failed by a reader while queued
            return None
        if claimed[0] == "orphaned":
            log.info("skipped job %s: nobody follows it any more", job_id, extra={"job_id": job_id})
            return None
        spec_json = claimed[1]
        try:
            spec = JobSpec.from_json(spec_json)
        except (ValueError, TypeError) as exc:  # not a web process's job: end it, serve the next
            self.finish(job_id, "error", {"code": "invalid_request", "message": f"unreadable job: {exc}"})
            return None
        self.publish(job_id, "started", {"worker": self.worker_id, "queue_ms": (now - spec.created) * 1000})
        return spec

    def publish(self, job_id: str, event_type: str, data: dict) -> str | None:
        """Append an event; returns its entry id, or None when the job no longer exists."""
        return self._publish(keys=[events_key(job_id), job_key(job_id)], args=[event_type, json.dumps(data)])

    def cancelled(self, job_id: str) -> str | None:
        """Why the job should stop, or None: someone asked to stop it ("cancel"), the job is gone (a Redis
        restart emptied it: "gone"), a reader has ended it (its worker looked lost: "ended"), or nobody has
        followed it for longer than its grace ("orphaned"). Stop in every case. One round trip."""
        return self._cancelled(keys=[cancel_key(job_id), job_key(job_id), followers_key(job_id)]) or None

    def finish(self, job_id: str, event_type: str, data: dict) -> bool:
        """Publish the terminal event (done or error) and mark the job, in one round trip.
        Returns False when the job no longer exists (nothing is written then)."""
        status = "error" if event_type == "error" else "done"
        if data.get("finish_reason") == "cancelled":
            status = "cancelled"
        args = [event_type, json.dumps(data), status, time.time(), EVENTS_TTL_S]
        keys = [events_key(job_id), job_key(job_id), followers_key(job_id)]
        return bool(self._finish(keys=keys, args=args))


# ---- the web's side (redis.asyncio client) -----------------------------------------------------


class JobClient:
    """What a web process does to Redis. `r` is a `redis.asyncio.Redis(decode_responses=True)`."""

    # Atomic "place unless the queue is full or its visitor has enough jobs", with the submitter's lease taken
    # before any worker can pop the job: KEYS: queue, job hash, followers, turns, round, visitor's jobs; ARGV: id,
    # spec, max, now, model, ttl, then the follower ('' for none: the job is never orphaned), its grace and the
    # lease's lifetime, then the key prefixes of jobs, followers and events, a cancelled end's data and an
    # ended job's ttl, then the visitor ('' for none), its cap (0: none), the workers' and the ticks' key prefixes. A full
    # queue first lets go of the queued jobs nobody follows any more (their web process died, their page
    # closed): ended as cancelled here, as a worker would end them on popping them, rather than holding their
    # places until then. Returns the queue's length, -1 (full) or -2 (the visitor's cap).
    _SUBMIT = """
    local function full()
        return tonumber(ARGV[3]) > 0 and redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[3])
    end
    -- whether a job of the visitor's counts against its cap: queued and followed, or running on a live worker
    local function active(id)
        local job = ARGV[10] .. id
        local status = redis.call('HGET', job, 'status')
        if status == 'queued' then return not orphaned(job, ARGV[11] .. id) end
        if status ~= 'running' then return false end
        local worker = redis.call('HGET', job, 'worker')
        return worker ~= false and redis.call('EXISTS', ARGV[17] .. worker) == 1
    end
    local visitor, cap = ARGV[15], tonumber(ARGV[16])
    if visitor ~= '' and cap > 0 then
        local count = 0
        for _, id in ipairs(redis.call('SMEMBERS', KEYS[6])) do
            if active(id) then count = count + 1 else redis.call('SREM', KEYS[6], id) end
        end
        if count >= cap then return -2 end
    end
    if full() then
        for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
            local job, followers = ARGV[10] .. id, ARGV[11] .. id
            if redis.call('HGET', job, 'status') == 'queued' and orphaned(job, followers) then
                redis.call('LREM', KEYS[1], 0, id)
                end_unstarted(job, followers, ARGV[12] .. id, ARGV[4], ARGV[13], ARGV[14])
                tick(ARGV[18], ARGV[5])
            end
        end
        if full() then return -1 end
    end
    -- the job's round: one past its visitor's last, never before the round being served
    local round = tonumber(redis.call('GET', KEYS[5]) or 0)
    if visitor ~= '' then
        local last = redis.call('HGET', KEYS[4], visitor)
        if last then round = math.max(round, tonumber(last) + 1) end
        redis.call('HSET', KEYS[4], visitor, round)
        redis.call('EXPIRE', KEYS[4], ARGV[6])
        redis.call('SADD', KEYS[6], ARGV[1])
        redis.call('EXPIRE', KEYS[6], ARGV[6])
    end
    redis.call('HSET', KEYS[2], 'spec', ARGV[2], 'status', 'queued', 'created', ARGV[4], 'model', ARGV[5],
               'round', round, 'visitor', visitor)
    redis.call('EXPIRE', KEYS[2], ARGV[6])
    if ARGV[7] ~= '' then
        redis.call('HSET', KEYS[2], 'grace', ARGV[8])
        redis.call('ZADD', KEYS[3], now() + tonumber(ARGV[9]), ARGV[7])
        redis.call('EXPIRE', KEYS[3], ARGV[6])
    end
    -- after the last queued job of this round or an earlier one (the queue's rounds never decrease)
    local queued = redis.call('LRANGE', KEYS[1], 0, -1)
    for i = #queued, 1, -1 do
        if tonumber(redis.call('HGET', ARGV[10] .. queued[i], 'round') or 0) <= round then
            if i < #queued then tick(ARGV[18], ARGV[5]) end  -- ahead of others: their positions moved
            return redis.call('LINSERT', KEYS[1], 'AFTER', queued[i], ARGV[1])
        end
    end
    if #queued > 0 then tick(ARGV[18], ARGV[5]) end
    return redis.call('LPUSH', KEYS[1], ARGV[1])
    """

    # A follower's lease renewed, while the job has not ended: KEYS: job, followers; ARGV: follower, the
    # lease's lifetime, the set's ttl. Leases lapsed a minute ago go (the renewed one keeps the set's last
    # expiry). Returns 0 once the job has ended or is gone (nothing is written then), else 1.
    _LEASE = """
    if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'finished') == 1 then
        return 0
    end
    local t = now()
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', t - 60)
    redis.call('ZADD', KEYS[2], t + tonumber(ARGV[2]), ARGV[1])
    redis.call('EXPIRE', KEYS[2], ARGV[3])
    return 1
    """

    # A follower that leaves on purpose lets its lease lapse now (KEYS: followers; ARGV: follower); the
    # member stays, so that the job's grace counts from this moment.
    _RELEASE = """
    local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
    local t = now()
    if expiry and tonumber(expiry) > t then redis.call('ZADD', KEYS[1], t, ARGV[1]) end
    """

    # 1 while some follower's lease is live. KEYS: followers.
    _FOLLOWED = """
    local last = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    if last[2] and tonumber(last[2]) > now() then return 1 end
    return 0
    """

    # The live workers' heartbeats, forgetting in the same step the registered ids whose heartbeat key has expired:
    # KEYS[1]=the registry; ARGV[1]=the heartbeat keys' prefix. A heartbeat's TTL is Redis' own clock, so a
    # worker is live exactly while its key is there: no host's clock is compared with another's (a registry score
    # taken before a heartbeat that retried through a Redis restart had hidden a worker that was back).
    _LIVE_WORKERS = """
    local live = {}
    for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
        local beat = redis.call('GET', ARGV[1] .. id)
        if beat then table.insert(live, beat) else redis.call('ZREM', KEYS[1], id) end
    end
    return live
    """

    # A popped, unclaimed job marked lost, only while still queued (WorkerChannel._CLAIM's counterpart).
    # KEYS: job. Returns 1 when this call marked it.
    _MARK_LOST = """
    if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
    redis.call('HSET', KEYS[1], 'status', 'error')
    return 1
    """

    def __init__(self, r, max_queue: int = 0, max_per_visitor: int = 0):
        self.r = r
        self.max_queue = max_queue  # 0: unbounded
        self.max_per_visitor = max_per_visitor  # jobs queued or running per visitor; 0: unbounded
        self._submit = r.register_script(_LEASE_LUA + self._SUBMIT)
        self._live_workers = r.register_script(self._LIVE_WORKERS)
        self._mark_lost = r.register_script(self._MARK_LOST)
        self._lease = r.register_script(_LEASE_LUA + self._LEASE)
        self._release = r.register_script(_LEASE_LUA + self._RELEASE)
        self._followed = r.register_script(_LEASE_LUA + self._FOLLOWED)
        self._record_speed = r.register_script(self._RECORD_SPEED)

    async def submit(
        self, spec: JobSpec, follower: str | None = None, grace_s: float = 0.0, visitor: str = ""
    ) -> str:
        """Queue a job in its `visitor`'s turn; returns its id. Raises QueueFull when the model's queue is at
        `max_queue` with jobs someone still follows (or that were submitted without a lease): orphans make
        room; VisitorBusy when the visitor (an address, an API key; '' for none) has `max_per_visitor` jobs
        queued or running.

        With a `follower` id, that follower's lease is taken in the same step, and the job is cancelled by
        its worker once no lease has been live for `grace_s` (see `lease`); without one it never is."""
        args = [spec.id, spec.to_json(), self.max_queue, spec.created, spec.model, EVENTS_TTL_S * 24]
        args += [follower or "", grace_s, LEASE_TTL_S, job_key(""), followers_key(""), events_key("")]
        args += [json.dumps(_cancelled_before_start()), EVENTS_TTL_S]
        args += [visitor, self.max_per_visitor, worker_key(""), moved_key("")]
        keys = [queue_key(spec.model), job_key(spec.id), followers_key(spec.id)]
        keys += [turns_key(spec.model), round_key(spec.model), visitor_key(visitor)]
        length = await self._submit(keys=keys, args=args)
        if length == -1:
            raise QueueFull(
                f"the queue for {spec.model} is full ({self.max_queue} waiting); try again shortly"
            )
        if length == -2:
            raise VisitorBusy(
                f"you have {self.max_per_visitor} generations queued or running, the most one visitor may "
                "have at once; try again when one has finished"
            )
        return spec.id

    async def status(self, job_id: str) -> dict:
        return await self.r.hgetall(job_key(job_id))

    async def lease(self, job_id: str, follower: str) -> bool:
        """Take or renew `follower`'s lease on the job for LEASE_TTL_S; every follower does so every
        LEASE_INTERVAL_S. False once the job has ended or is gone: there is nothing left to hold."""
        args = [follower, LEASE_TTL_S, EVENTS_TTL_S * 24]
        return bool(await self._lease(keys=[job_key(job_id), followers_key(job_id)], args=args))

    async def release(self, job_id: str, follower: str) -> None:
        """`follower` stops following the job: its lease lapses now rather than LEASE_TTL_S later."""
        await self._release(keys=[followers_key(job_id)], args=[follower])

    async def followed(self, job_id: str) -> bool:
        """Whether some follower's lease on the job is live."""
        return bool(await self._followed(keys=[followers_key(job_id)]))

    async def position(self, job_id: str, model: str) -> int | None:
        """Jobs ahead of this one in its queue; None once a worker has taken it."""
        return await self.r.lpos(queue_key(model), job_id)

    async def cancel(self, job_id: str) -> None:
        """Stop a job: a queued one leaves the queue at once, a running one stops at the next flush."""
        job = await self.r.hgetall(job_key(job_id))
        await self.r.set(cancel_key(job_id), "1", ex=EVENTS_TTL_S)
        if job.get("status") == "queued" and await self.r.lrem(queue_key(job["model"]), 0, job_id):
            await self.tick(job["model"])
            await self._fail_terminal(job_id, "done", _cancelled_before_start())

    # A finished job's decode speed and length folded into its model's moving averages (the first one is
    # taken as it is). KEYS: speed; ARGV: tok_s, job_s, weight, ttl.
    _RECORD_SPEED = """
    for i, name in ipairs({'tok_s', 'job_s'}) do
        local old, new = redis.call('HGET', KEYS[1], name), tonumber(ARGV[i])
        if old then new = tonumber(old) * (1 - tonumber(ARGV[3])) + new * tonumber(ARGV[3]) end
        redis.call('HSET', KEYS[1], name, new)
    end
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    """

    async def record_speed(self, model: str, stats: dict) -> None:
        """Fold a finished job's stats (the worker's: decode_tok_s, total_ms) into `model`'s averages."""
        tok_s, total_ms = stats.get("decode_tok_s"), stats.get("total_ms")
        if not tok_s or not total_ms:
            return  # too short to say (a token or two), or not run
        args = [float(tok_s), float(total_ms) / 1000, SPEED_WEIGHT, EVENTS_TTL_S * 24 * 7]
        await self._record_speed(keys=[speed_key(model)], args=args)

    async def speed(self, model: str) -> dict[str, float]:
        """`model`'s moving averages: {"tok_s", "job_s"}, empty before any job of it was measured."""
        return {name: float(value) for name, value in (await self.r.hgetall(speed_key(model))).items()}

    async def estimated_wait_s(self, model: str, position: int | None, workers: int) -> float | None:
        """About how long a job `position` places from the head waits for a worker: the jobs ahead and the
        one running take a model's average job each, shared by its workers. None when nothing says."""
        if position is None or not workers:
            return None
        job_s = (await self.speed(model)).get("job_s")
        return None if job_s is None else round((position + 1) * job_s / workers, 1)

    async def tick(self, model: str) -> None:
        """Wake the followers of `model`'s queued jobs: their positions changed."""
        await self.r.xadd(moved_key(model), {"moved": "1"}, maxlen=MOVED_MAXLEN, approximate=True)

    async def forget(self, job_id: str) -> None:
        """Drop an ended job's record and events at once, where their one reader has read them (a tokenizer job's
        answer: its prompt would otherwise stay in Redis for the events' TTL)."""
        await self.r.delete(job_key(job_id), events_key(job_id), followers_key(job_id), cancel_key(job_id))

    async def outcome(self, job_id: str, block_ms: int = 250, known: bool = False) -> tuple[str, dict]:
        """The job's terminal event, (type, data), once it comes: where events() ends."""
        kind, data = "", {}
        async for _, kind, data in self.events(job_id, block_ms=block_ms, known=known):  # noqa: B007
            pass
        return kind, data

    async def workers(self) -> list[dict]:
        """The heartbeats of the live workers (a killed worker drops out after HEARTBEAT_TTL_S)."""
        beats = await self._live_workers(keys=[workers_key()], args=[worker_key("")])
        return [json.loads(beat) for beat in beats]

    async def events(
        self, job_id: str, after: str = "0-0", block_ms: int = 250, known: bool = False
    ) -> AsyncIterator[tuple[str, str, dict]]:
        """Yield (entry_id, type, data) from entry `after` on, until done or error.

        While waiting it also yields ("", "queue", {"position", "workers", "wait_s"}) when the position changes,
        and turns a dead worker or a lost job into an error event that every reader then sees.
        `known`: the caller knows the job existed (it submitted it, or saw its record), so a job missing
        from Redis was lost to a restart (queue_restarted), never an unknown id, even before its first event.
        """
        watch = _Watch()
        seen_job = known or after != "0-0"  # a resumed reader knows the job existed
        queued_in = None  # while the job is queued: its model, whose queue's ticks wake this reader too
        ticks_after = "0-0"  # the last tick seen
        while True:
            streams = {events_key(job_id): after}
            if queued_in is not None:
                streams[moved_key(queued_in)] = ticks_after
            # never past the doubts' own deadlines (a pop never claimed, a model nobody serves)
            queued_block = min(QUEUED_BLOCK_MS, int(1000 * min(LOST_CLAIM_S, NO_WORKER_WAIT_S)))
            block = queued_block if queued_in is not None else block_ms
            reply = await self.r.xread(streams, block=block, count=512)
            moved = False
            for stream, entries in reply or []:
                if stream != events_key(job_id):
                    ticks_after, moved = entries[-1][0], True
                    continue
                for entry_id, entry in entries:
                    after = entry_id
                    event_type = entry["type"]
                    yield entry_id, event_type, json.loads(entry["data"])
                    if event_type in TERMINAL:
                        return
                seen_job = True
                watch.popped_at = watch.dropped_at = None  # the job moves: the doubts start over
            if reply and not moved:
                continue
            job = await self.r.hgetall(job_key(job_id))
            if not job and seen_job:
                # It was there: Redis restarted without its data. Nothing is written back (that
                # would re-create the job's keys); each reader reports it itself.
                yield "", "error", _queue_restarted()
                return
            if not job:
                await self._fail_terminal(job_id, "error", {"code": "unknown_job", "message": "no such job"})
                continue
            seen_job = True
            if job["status"] == "queued":
                if queued_in is None:  # from now on, only the ticks that come after this look
                    queued_in = job["model"]
                    last = await self.r.xrevrange(moved_key(queued_in), count=1)
                    ticks_after = last[0][0] if last else "0-0"
                update = await self._watch_queued(job_id, job, watch)
                if update is not None:
                    yield "", "queue", update
            else:
                queued_in = None
                if job["status"] == "running":
                    await self._watch_running(job_id, job, watch)

    async def _watch_queued(self, job_id: str, job: dict, watch: _Watch) -> dict | None:
        """A queued job's position and workers when they changed; ends the job if it waits in vain."""
        position = await self.position(job_id, job["model"])
        serving = [w for w in await self.workers() if job["model"] in w.get("models", [])]
        # A worker claims what it pops within milliseconds; only a job popped and then left unclaimed
        # for LOST_CLAIM_S (its worker died in between) is lost. The clock starts when the job leaves
        # the queue, not when this reader began waiting behind others.
        watch.popped_at = _since(watch.popped_at, position is None)
        watch.unserved_at = _since(watch.unserved_at, position is not None and not serving)
        now = time.monotonic()
        if watch.popped_at is not None and now - watch.popped_at > LOST_CLAIM_S:
            await self._fail_lost_claim(job_id)
        elif watch.unserved_at is not None and now - watch.unserved_at > NO_WORKER_WAIT_S:
            if await self.r.lrem(queue_key(job["model"]), 0, job_id):  # else a worker took it just now
                await self._fail_terminal(job_id, "error", _unserved(job["model"]))
        elif (position, len(serving)) != watch.last_position:
            watch.last_position = (position, len(serving))
            wait_s = await self.estimated_wait_s(job["model"], position, len(serving))
            return {"position": position, "workers": len(serving), "wait_s": wait_s}
        return None

    async def _watch_running(self, job_id: str, job: dict, watch: _Watch) -> None:
        """Ends a running job whose worker is gone, or alive but no longer working on it (it dropped the
        job when Redis failed under it, or a worker of the same id restarted)."""
        beat = await self.r.get(worker_key(job.get("worker", "")))
        if beat is None:
            await self._fail_terminal(job_id, "error", _lost("lost its worker mid-generation"))
            return
        watch.dropped_at = _since(watch.dropped_at, _job_of(beat) != job_id)
        if watch.dropped_at is not None and time.monotonic() - watch.dropped_at > DROPPED_JOB_S:
            await self._fail_terminal(job_id, "error", _lost("was dropped by its worker"))

    async def _fail_lost_claim(self, job_id: str) -> None:
        """Fail a popped job that no worker claimed, unless a worker claims it at this moment: the status is
        set only while still queued (the worker's claim checks the same), so exactly one of the two wins."""
        if await self._mark_lost(keys=[job_key(job_id)]):
            await self._fail_terminal(job_id, "error", _lost("was taken by a worker that never started it"))

    async def _fail_terminal(self, job_id: str, event_type: str, data: dict) -> None:
        """Write a terminal event unless one is there already (several readers may race here)."""
        status = "cancelled" if data.get("finish_reason") == "cancelled" else event_type
        if await self.r.hsetnx(job_key(job_id), "finished", time.time()):
            pipe = self.r.pipeline()
            pipe.xadd(events_key(job_id), _entry(event_type, data))
            pipe.hset(job_key(job_id), "status", status)
            pipe.delete(followers_key(job_id))
            pipe.expire(events_key(job_id), EVENTS_TTL_S)
            pipe.expire(job_key(job_id), EVENTS_TTL_S)  # hsetnx made a stub when the job was unknown
            await pipe.execute()


def release_leases(r, leases: list[tuple[str, str]]) -> None:
    """Let (job id, follower) leases lapse now, in one round trip, from a sync client `r`: for a web process
    that exits (daphne asked to stop), so that its jobs' grace starts at once rather than LEASE_TTL_S later."""
    script = r.register_script(_LEASE_LUA + JobClient._RELEASE)
    pipe = r.pipeline(transaction=False)
    for job_id, follower in leases:
        script(keys=[followers_key(job_id)], args=[follower], client=pipe)
    pipe.execute()


@dataclass
class _Watch:
    """What one reader has seen of its job while no event came: since when each doubt has held."""

    last_position: tuple | None = None
    popped_at: float | None = None  # out of the queue, not claimed
    unserved_at: float | None = None  # queued, and no live worker serves its model
    dropped_at: float | None = None  # running, and its worker's heartbeat names another job or none


def _since(start: float | None, holds: bool) -> float | None:
    """When a condition began to hold (now, if it just did), or None while it does not."""
    return (start or time.monotonic()) if holds else None


def _job_of(beat: str) -> str | None:
    try:
        return json.loads(beat).get("job")
    except (ValueError, AttributeError):
        return None


def _unserved(model: str) -> dict:
    return {
        "code": "no_workers",
        "message": f"No worker has served {model} for {NO_WORKER_WAIT_S:g} s; please try again later.",
    }


def _lost(why: str) -> dict:
    return {"code": "worker_lost", "message": f"The job {why}; please try again."}


def _queue_restarted() -> dict:
    return {
        "code": "queue_restarted",
        "message": "The job queue restarted and lost this generation; please run it again.",
    }


def _cancelled_before_start() -> dict:
    return {"finish_reason": "cancelled", "text": "", "stats": None}
