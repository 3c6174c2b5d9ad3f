"""The admin's login, throttled: at most PLAYGROUND_ADMIN_LOGINS_PER_MIN wrong passwords a minute per address
(rate_identity), counted in Redis so that every web process shares the count; past it, the login answers 429
with a Retry-After, whatever the password, until the oldest failure leaves the minute.

    PLAYGROUND_ADMIN_LOGINS_PER_MIN   wrong passwords per address a minute (default 5; 0: no throttle)
    PLAYGROUND_ADMIN_PATH             where the admin lives (default admin/): a path of your own keeps the
                                      login page out of every scanner's first guess
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import redis
from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.http import HttpResponse
from django.urls import reverse

from common.protocol import PREFIX
from playground.limits import configured, ip_from_request, rate_identity

log = logging.getLogger(__name__)
WINDOW_S = 60.0


def failures_key(ip: str) -> str:
    return f"{PREFIX}admin_login_failures:{rate_identity(ip)}"


class AdminLoginThrottle:
    """Middleware (async): looks at POSTs to the admin's login only."""

    async_capable, sync_capable = True, False

    def __init__(self, get_response):
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request):
        limit = settings.PLAYGROUND_ADMIN_LOGINS_PER_MIN
        if not limit or request.method != "POST" or request.path != reverse("admin:login"):
            return await self.get_response(request)
        from playground.jobs import job_client  # the web process's Redis connection, per event loop

        r = job_client().r
        key = failures_key(ip_from_request(request, configured().trusted_proxies))
        now = time.time()
        try:
            pipe = r.pipeline(transaction=False)
            pipe.zremrangebyscore(key, "-inf", now - WINDOW_S)
            pipe.zrange(key, 0, 0, withscores=True)
            pipe.zcard(key)
            _, oldest, failures = await pipe.execute()
        except redis.RedisError as exc:  # the password still guards the admin; Redis' outage is logged
            log.warning("admin login throttle unavailable: %s", exc)
            return await self.get_response(request)
        if failures >= limit:
            retry = max(1, math.ceil(oldest[0][1] + WINDOW_S - now)) if oldest else int(WINDOW_S)
            log.warning("admin login throttled for %s", key.rsplit(":", 1)[-1])
            response = HttpResponse(
                f"Too many wrong passwords from your address; try again in {retry} s.\n",
                status=429,
                content_type="text/plain; charset=utf-8",
            )
            response["Retry-After"] = str(retry)
            return response
        response = await self.get_response(request)
        if response.status_code == 200:  # the form again: the password was wrong (a login redirects)
            try:
                await r.zadd(key, {f"{now}:{uuid.uuid4().hex}": now})
                await r.expire(key, int(WINDOW_S) + 1)
            except redis.RedisError as exc:
                log.warning("could not count a failed admin login: %s", exc)
        return response
