"""Rate limits shared by every web process through Redis: per client IP and per API key.

Two budgets per identity, each over a sliding window (`window_s`, a minute by default):
requests (counted when a job is admitted, and given back when the full queue turns the job away) and
generated tokens (charged when a job finishes, checked before the next one starts). A budget of 0
switches that limit off.

    PLAYGROUND_IP_REQUESTS_PER_MIN     requests per client IP (default 30)
    PLAYGROUND_IP_TOKENS_PER_MIN       generated tokens per client IP (default auto: half of what the live
                                       workers were measured to produce in a window, so that it binds
                                       whatever the hardware; 50000 until a job was measured)
    PLAYGROUND_KEY_REQUESTS_PER_MIN    requests per API key (default 120)
    PLAYGROUND_KEY_TOKENS_PER_MIN      generated tokens per API key (default 200000)
    PLAYGROUND_RATE_WINDOW_S           the window, in seconds (default 60; the tests shorten it)
    PLAYGROUND_TRUSTED_PROXIES         comma-separated IPs or networks (10.0.0.0/8) whose
                                       X-Forwarded-For is believed; empty: the peer is the client

They are read once, when the web process starts (check_environment, from the app's ready()): a value that
is not what its variable takes stops it there, naming the variable.

A request with an API key is limited by the key, not by the IP: a team behind one NAT address
with its own key is not throttled as one stranger. Each budget is a sorted set of
(member, time) entries that only ever holds one window's worth, so it stays as small as its limit:
the check, the eviction and the record happen in one Lua script, atomic across processes.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import os
import time
import uuid
from dataclasses import dataclass

from common.env import env_number
from common.protocol import PREFIX, JobClient
from playground import metrics

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _env_int(name: str, default: int) -> int:
    return int(
        env_number(name, default, "a whole number, 0 or more (0 switches the limit off)", integer=True)
    )


def _env_seconds(name: str, default: float) -> float:
    return env_number(name, default, "a number of seconds, greater than 0", above=True)


def parse_networks(text: str, name: str = "PLAYGROUND_TRUSTED_PROXIES") -> tuple[IPNetwork, ...]:
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{name}: {item!r} is not an IP address or network") from None
    return tuple(networks)


AUTO = None  # a token budget sized from the workers' measured speed
AUTO_SHARE = 0.5  # of what the live workers produce in a window: one address may take half
AUTO_FALLBACK_TOKENS = 50_000  # until a finished job has said how fast the workers are
AUTO_CACHE_S = 5.0  # how long a sized budget is kept before the workers are looked at again


def _env_tokens(name: str) -> int | None:
    if os.environ.get(name, "").strip().lower() in ("", "auto"):
        return AUTO
    return _env_int(name, 0)


@dataclass(frozen=True)
class LimitConfig:
    ip_requests: int = 30
    ip_tokens: int | None = AUTO
    key_requests: int = 120
    key_tokens: int = 200_000
    window_s: float = 60.0
    trusted_proxies: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_env(cls) -> LimitConfig:
        """Raises ValueError naming the variable and what it takes (check_environment: at the process's start)."""
        return cls(
            ip_requests=_env_int("PLAYGROUND_IP_REQUESTS_PER_MIN", cls.ip_requests),
            ip_tokens=_env_tokens("PLAYGROUND_IP_TOKENS_PER_MIN"),
            key_requests=_env_int("PLAYGROUND_KEY_REQUESTS_PER_MIN", cls.key_requests),
            key_tokens=_env_int("PLAYGROUND_KEY_TOKENS_PER_MIN", cls.key_tokens),
            window_s=_env_seconds("PLAYGROUND_RATE_WINDOW_S", cls.window_s),
            trusted_proxies=parse_networks(os.environ.get("PLAYGROUND_TRUSTED_PROXIES", "")),
        )


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_s: int = 0  # whole seconds, as Retry-After wants; 0 when allowed
    limit: str = ""  # which budget refused: "ip_requests", "key_tokens", ...
    message: str = ""  # one line for the person: what the limit is and when to come back
    # where an admitted request was counted (the request budgets' keys, and its member in them): refund()
    counted: tuple[tuple[str, ...], str] | None = None


# ---- who is asking ---------------------------------------------------------------------------------


def client_ip(peer: str | None, forwarded_for: str | None, trusted: tuple[IPNetwork, ...]) -> str:
    """The client's address: the peer, unless the peer is a trusted proxy.

    Then X-Forwarded-For is read right to left (each proxy appends the address it saw), skipping
    trusted proxies: the first untrusted hop is the client. Anything left of it was written by the
    client itself and proves nothing.
    """
    hop = _parse_ip(peer)
    if hop is None:
        return peer or "unknown"
    if not forwarded_for or not _trusted(hop, trusted):
        return str(hop)
    for item in reversed(forwarded_for.split(",")):
        address = _parse_ip(item)
        if address is None:  # garbage from a hop we cannot vouch for: stop at the last good one
            break
        hop = address
        if not _trusted(hop, trusted):
            break
    return str(hop)


def rate_identity(ip: str) -> str:
    """The unit an IP budget is kept for: the address, or its /64 for IPv6 (one host's usual share)."""
    address = _parse_ip(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else address or ip)


def visitor(ip: str, api_key: str | None = None) -> str:
    """Who a fair share is kept for (jobs at once, the queue's turns): the API key (its id) when there is one,
    else the address as its budgets see it."""
    return f"key:{api_key}" if api_key is not None else f"ip:{rate_identity(ip)}"


def ip_from_request(request, trusted: tuple[IPNetwork, ...]) -> str:
    return client_ip(request.META.get("REMOTE_ADDR"), request.META.get("HTTP_X_FORWARDED_FOR"), trusted)


def ip_from_scope(scope: dict, trusted: tuple[IPNetwork, ...]) -> str:
    """The same for a Channels (ASGI) scope: the peer is scope["client"], headers are raw bytes."""
    peer = (scope.get("client") or [None])[0]
    forwarded = [v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-forwarded-for"]
    return client_ip(peer, ",".join(forwarded) or None, trusted)


def _parse_ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address((text or "").strip())
    except ValueError:
        return None


def _trusted(address, trusted: tuple[IPNetwork, ...]) -> bool:
    return any(address.version == net.version and address in net for net in trusted)


# ---- the budgets -----------------------------------------------------------------------------------

# KEYS: the budgets' sorted sets. ARGV: now, window, then per key: kind (r|t), limit; then the member
# recorded in every request budget. Entries older than the window go first. A request budget is full
# at `limit` entries; a token budget's members end in ":<tokens>" and it is full at `limit` tokens.
# Returns {index of the refusing key (1-based) or 0, seconds until it has room}.
_ADMIT = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local member = ARGV[3 + 2 * #KEYS]
for i, key in ipairs(KEYS) do
  local kind, limit = ARGV[1 + 2 * i], tonumber(ARGV[2 + 2 * i])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  if kind == 'r' then
    local count = redis.call('ZCARD', key)
    if count >= limit then
      local oldest = redis.call('ZRANGE', key, count - limit, count - limit, 'WITHSCORES')
      return {i, tostring(tonumber(oldest[2]) + window - now)}
    end
  else
    local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
    local total = 0
    for j = 1, #entries, 2 do total = total + tonumber(string.match(entries[j], ':(%d+)$')) end
    if total >= limit then
      -- room comes back when enough of the oldest entries have left the window
      for j = 1, #entries, 2 do
        total = total - tonumber(string.match(entries[j], ':(%d+)$'))
        if total < limit then return {i, tostring(tonumber(entries[j + 1]) + window - now)} end
      end
    end
  end
end
for i, key in ipairs(KEYS) do
  if ARGV[1 + 2 * i] == 'r' then
    redis.call('ZADD', key, now, member)
    redis.call('PEXPIRE', key, math.ceil(window * 1000))
  end
end
return {0, '0'}
"""

_CHARGE = """
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000))
"""

LIMIT_WORDS = {
    "ip_requests": ("requests", "per IP address"),
    "ip_tokens": ("generated tokens", "per IP address"),
    "key_requests": ("requests", "per API key"),
    "key_tokens": ("generated tokens", "per API key"),
}


class RateLimiter:
    """`r` is a redis.asyncio client (decode_responses=True), shared with the JobClient."""

    def __init__(self, r, config: LimitConfig):
        self.r = r
        self.config = config
        self._admit = r.register_script(_ADMIT)
        self._charge = r.register_script(_CHARGE)

    def _budgets(self, ip: str, api_key: str | None, ip_tokens: int = 1) -> list[tuple[str, str, int]]:
        """(name, redis key, limit) of the budgets that apply and are switched on; `ip_tokens`: the IP's token
        budget when the config sizes it from the workers (AUTO)."""
        c = self.config
        if api_key is not None:
            who, budgets = f"key:{api_key}", [("key_requests", c.key_requests), ("key_tokens", c.key_tokens)]
        else:
            tokens = ip_tokens if c.ip_tokens is AUTO else c.ip_tokens
            who, budgets = f"ip:{rate_identity(ip)}", [("ip_requests", c.ip_requests), ("ip_tokens", tokens)]
        return [(name, f"{PREFIX}rate:{name}:{who}", limit) for name, limit in budgets if limit > 0]

    async def measured_ip_tokens(self) -> int:
        """The IP token budget sized from what the live workers produce in a window: AUTO_SHARE of it (each
        worker at the measured decode speed of the fastest model it serves), kept AUTO_CACHE_S."""
        now = time.monotonic()
        sized_at, tokens = getattr(self, "_sized", (None, 0))
        if sized_at is not None and now - sized_at < AUTO_CACHE_S:
            return tokens
        jobs = JobClient(self.r)
        speeds: dict[str, float] = {}
        per_s = 0.0
        for worker in await jobs.workers():
            for model in worker.get("models", []):
                if model not in speeds:
                    speeds[model] = (await jobs.speed(model)).get("tok_s", 0.0)
            per_s += max((speeds[m] for m in worker.get("models", [])), default=0.0)
        tokens = math.ceil(per_s * self.config.window_s * AUTO_SHARE) if per_s else AUTO_FALLBACK_TOKENS
        self._sized = (now, tokens)
        return tokens

    async def admit(self, ip: str, api_key: str | None = None, now: float | None = None) -> Verdict:
        """Check every budget and, when all have room, count this request. `api_key` is an id of the
        key (never the secret); with one, the key's budgets apply instead of the IP's."""
        sized = await self.measured_ip_tokens() if api_key is None and self.config.ip_tokens is AUTO else 1
        budgets = self._budgets(ip, api_key, sized)
        if not budgets:
            return Verdict(True)
        now = time.time() if now is None else now
        args: list = [now, self.config.window_s]
        for name, _, limit in budgets:
            args += ["r" if name.endswith("requests") else "t", limit]
        member = f"{now}:{uuid.uuid4().hex}"
        args.append(member)
        refused, wait = await self._admit(keys=[key for _, key, _ in budgets], args=args)
        if not refused:
            request_keys = tuple(key for name, key, _ in budgets if name.endswith("requests"))
            return Verdict(True, counted=(request_keys, member))
        name, _, limit = budgets[int(refused) - 1]
        retry_after = max(1, math.ceil(float(wait)))
        what, per = LIMIT_WORDS[name]
        window = f"{self.config.window_s:g} s" if self.config.window_s != 60 else "minute"
        message = f"Rate limit reached: {limit} {what} per {window} {per}; try again in {retry_after} s"
        metrics.RATE_LIMITED.labels(limit=name).inc()
        return Verdict(False, retry_after, name, message)

    async def refund(self, verdict: Verdict) -> None:
        """Give back an admitted request that was not served after all (the model's queue was full): a
        client that honours the queue's Retry-After must not run out of requests for being turned away."""
        if verdict.counted is None:
            return
        keys, member = verdict.counted
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.zrem(key, member)
        await pipe.execute()

    async def charge_tokens(
        self, ip: str, api_key: str | None, tokens: int, job_id: str, now: float | None = None
    ) -> None:
        """Count a finished job's generated tokens against its budget (once per job id)."""
        if tokens <= 0:
            return
        now = time.time() if now is None else now
        for name, key, _ in self._budgets(ip, api_key):
            if name.endswith("tokens"):
                await self._charge(keys=[key], args=[now, self.config.window_s, f"{job_id}:{int(tokens)}"])


def configured() -> LimitConfig:
    """settings.PLAYGROUND_LIMITS when a test or a deployment sets it, else the environment."""
    from django.conf import settings

    return getattr(settings, "PLAYGROUND_LIMITS", None) or _from_env_once()


def check_environment() -> None:
    """Read the variables above now, at the process's start (the app's ready()): a bad one stops daphne and
    manage.py with one line naming it, instead of a web process that answers /healthz and fails every
    generation with a 500."""
    from django.core.exceptions import ImproperlyConfigured

    try:
        configured()
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None


@functools.cache
def _from_env_once() -> LimitConfig:
    return LimitConfig.from_env()


def limiter() -> RateLimiter:
    """The web process's limiter, on the job client's Redis connection (one per event loop)."""
    from playground.jobs import job_client

    jobs, config = job_client(), configured()
    cached = getattr(jobs, "_limiter", None)
    if cached is None or cached.config is not config:
        cached = jobs._limiter = RateLimiter(jobs.r, config)
    return cached
