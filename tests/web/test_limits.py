"""Rate limits (playground/limits.py) on the suite's real Redis: budgets, windows, atomicity, client IPs."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess
import sys
import time

import pytest
import redis.asyncio as aioredis
from channels.testing import WebsocketCommunicator

from common.redis_server import free_port
from playground.limits import (
    AUTO,
    AUTO_FALLBACK_TOKENS,
    LimitConfig,
    RateLimiter,
    client_ip,
    ip_from_scope,
    parse_networks,
    rate_identity,
)
from playground.metrics import REGISTRY
from tests.support import ROOT, SAME_ORIGIN

T0 = 1_700_000_000.0


@pytest.fixture
async def r(redis_url):
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


def limiter(r, **budgets) -> RateLimiter:
    config = {"ip_requests": 0, "ip_tokens": 0, "key_requests": 0, "key_tokens": 0, **budgets}
    return RateLimiter(r, LimitConfig(**config))


def refusals(limit: str) -> float:
    return REGISTRY.get_sample_value("kog_rate_limited_total", {"limit": limit}) or 0.0


async def test_requests_per_ip_are_refused_at_the_limit_until_the_oldest_leaves_the_window(r):
    limits = limiter(r, ip_requests=3)
    before = refusals("ip_requests")
    for i in range(3):
        assert (await limits.admit("203.0.113.7", now=T0 + i)).allowed
    refused = await limits.admit("203.0.113.7", now=T0 + 10)
    assert not refused.allowed and refused.limit == "ip_requests"
    assert refused.retry_after_s == 50  # the first request (T0) leaves the window at T0 + 60
    assert "3 requests per minute per IP address" in refused.message and "50 s" in refused.message
    assert refusals("ip_requests") == before + 1
    # refusals are not counted: once the first request has left, exactly one more fits
    assert (await limits.admit("203.0.113.7", now=T0 + 60.5)).allowed
    assert not (await limits.admit("203.0.113.7", now=T0 + 60.6)).allowed
    # another address has its own budget
    assert (await limits.admit("203.0.113.8", now=T0 + 10)).allowed


async def test_generated_tokens_are_charged_at_the_end_and_checked_before_the_next_job(r):
    limits = limiter(r, ip_tokens=100)
    ip = "198.51.100.1"
    assert (await limits.admit(ip, now=T0)).allowed
    await limits.charge_tokens(ip, None, 60, job_id="a", now=T0 + 1)
    assert (await limits.admit(ip, now=T0 + 2)).allowed  # 60 < 100: the next job may start
    await limits.charge_tokens(ip, None, 60, job_id="b", now=T0 + 5)
    await limits.charge_tokens(ip, None, 60, job_id="b", now=T0 + 5)  # the same job twice counts once
    refused = await limits.admit(ip, now=T0 + 6)
    assert not refused.allowed and refused.limit == "ip_tokens"
    assert refused.retry_after_s == 55  # job a's 60 tokens leave at T0 + 61, leaving 60 < 100
    assert "100 generated tokens per minute" in refused.message
    assert (await limits.admit(ip, now=T0 + 61.5)).allowed


async def test_an_api_key_has_its_own_budget_instead_of_the_ip_one(r):
    limits = limiter(r, ip_requests=1, key_requests=2)
    ip = "192.0.2.10"
    assert (await limits.admit(ip, now=T0)).allowed
    assert not (await limits.admit(ip, now=T0)).allowed
    # the same address with a key is limited by the key only
    assert (await limits.admit(ip, api_key="7", now=T0)).allowed
    assert (await limits.admit(ip, api_key="7", now=T0)).allowed
    refused = await limits.admit(ip, api_key="7", now=T0)
    assert not refused.allowed and refused.limit == "key_requests" and "per API key" in refused.message
    assert (await limits.admit(ip, api_key="8", now=T0)).allowed


async def test_a_zero_budget_switches_the_limit_off(r):
    limits = limiter(r)
    assert all([(await limits.admit("192.0.2.1", now=T0)).allowed for _ in range(50)])
    assert await r.dbsize() == 0  # nothing is even recorded


async def test_concurrent_requests_from_many_processes_never_exceed_the_budget(r, redis_url):
    # Several clients (connections), as several daphne processes would have, all at once.
    clients = [aioredis.Redis.from_url(redis_url, decode_responses=True) for _ in range(4)]
    config = LimitConfig(ip_requests=10, ip_tokens=0, key_requests=0, key_tokens=0)
    limiters = [RateLimiter(c, config) for c in clients]
    verdicts = await asyncio.gather(*(limiters[i % 4].admit("192.0.2.77") for i in range(60)))
    assert sum(v.allowed for v in verdicts) == 10
    assert all(v.retry_after_s >= 1 for v in verdicts if not v.allowed)
    for c in clients:
        await c.aclose()


async def test_a_real_short_window_expires_and_its_keys_expire_too(r):
    limits = RateLimiter(r, LimitConfig(ip_requests=2, ip_tokens=0, window_s=0.4))
    assert (await limits.admit("192.0.2.5")).allowed
    assert (await limits.admit("192.0.2.5")).allowed
    refused = await limits.admit("192.0.2.5")
    assert not refused.allowed and refused.retry_after_s == 1  # rounded up to a whole second
    assert "per 0.4 s" in refused.message
    keys = await r.keys("*rate*")
    assert keys and all(0 < ttl <= 400 for ttl in [await r.pttl(k) for k in keys])
    await asyncio.sleep(0.5)
    assert (await limits.admit("192.0.2.5")).allowed


# ---- who the client is ---------------------------------------------------------------------------

PROXIES = parse_networks("10.0.0.0/8, 127.0.0.1, fd00::/8")


def test_x_forwarded_for_is_ignored_unless_the_peer_is_a_trusted_proxy():
    assert client_ip("203.0.113.9", "1.2.3.4", PROXIES) == "203.0.113.9"
    assert client_ip("203.0.113.9", None, ()) == "203.0.113.9"
    assert client_ip("10.1.2.3", None, PROXIES) == "10.1.2.3"


def test_the_client_is_the_first_untrusted_hop_from_the_right():
    # the client wrote "6.6.6.6" itself to look like someone else; our proxies appended the rest
    assert client_ip("10.0.0.2", "6.6.6.6, 203.0.113.50, 10.0.0.9", PROXIES) == "203.0.113.50"
    assert client_ip("127.0.0.1", "203.0.113.50", PROXIES) == "203.0.113.50"
    # only proxies in the chain: the leftmost one is as far as we can see
    assert client_ip("10.0.0.2", "10.0.0.7, 10.0.0.9", PROXIES) == "10.0.0.7"
    # garbage stops the walk at the last hop we could read
    assert client_ip("10.0.0.2", "203.0.113.50, not-an-ip, 10.0.0.9", PROXIES) == "10.0.0.9"
    assert client_ip("fd00::1", "2001:db8::5", PROXIES) == "2001:db8::5"


def test_a_channels_scope_gives_the_same_answer():
    scope = {"client": ["10.0.0.2", 50000], "headers": [(b"x-forwarded-for", b"203.0.113.50, 10.0.0.9")]}
    assert ip_from_scope(scope, PROXIES) == "203.0.113.50"
    assert ip_from_scope(scope, ()) == "10.0.0.2"
    assert ip_from_scope({"headers": []}, PROXIES) == "unknown"


def test_ipv6_clients_share_a_budget_per_64_and_mapped_ipv4_is_ipv4():
    assert (
        rate_identity("2001:db8:1:2:aaaa::1") == rate_identity("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    )
    assert rate_identity("2001:db8:1:3::1") != rate_identity("2001:db8:1:2::1")
    assert rate_identity("::ffff:192.0.2.1") == "192.0.2.1"
    assert rate_identity("192.0.2.1") == "192.0.2.1"


def test_settings_from_the_environment_are_validated_naming_the_variable(monkeypatch):
    monkeypatch.setenv("PLAYGROUND_IP_REQUESTS_PER_MIN", "5")
    monkeypatch.setenv("PLAYGROUND_TRUSTED_PROXIES", "10.0.0.0/8,::1")
    config = LimitConfig.from_env()
    assert config.ip_requests == 5 and config.key_requests == LimitConfig.key_requests
    assert config.trusted_proxies == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1"))
    monkeypatch.setenv("PLAYGROUND_KEY_TOKENS_PER_MIN", "lots")
    with pytest.raises(ValueError, match="PLAYGROUND_KEY_TOKENS_PER_MIN"):
        LimitConfig.from_env()
    monkeypatch.setenv("PLAYGROUND_KEY_TOKENS_PER_MIN", "1")
    monkeypatch.setenv("PLAYGROUND_TRUSTED_PROXIES", "10.0.0.0/33")
    with pytest.raises(ValueError, match="PLAYGROUND_TRUSTED_PROXIES: '10.0.0.0/33'"):
        LimitConfig.from_env()
    monkeypatch.setenv("PLAYGROUND_TRUSTED_PROXIES", "")
    for window in ("1m", "0", "-5", "nan", "inf"):
        monkeypatch.setenv("PLAYGROUND_RATE_WINDOW_S", window)
        with pytest.raises(
            ValueError, match=f"PLAYGROUND_RATE_WINDOW_S: must be a number of seconds.*'{window}'"
        ):
            LimitConfig.from_env()
    monkeypatch.setenv("PLAYGROUND_RATE_WINDOW_S", "0.5")
    assert LimitConfig.from_env().window_s == 0.5


@pytest.mark.parametrize(
    "name, value",
    [
        ("PLAYGROUND_IP_REQUESTS_PER_MIN", "ten"),
        ("PLAYGROUND_KEY_TOKENS_PER_MIN", "-1"),
        ("PLAYGROUND_RATE_WINDOW_S", "1m"),
        ("PLAYGROUND_TRUSTED_PROXIES", "10.0.0.1,proxy.local"),
    ],
)
def test_a_bad_limit_stops_the_web_process_at_its_start_instead_of_every_generation(name, value, tmp_path):
    # before: daphne started, /healthz said 200, and every generation was a 500 naming the variable in the log
    port = free_port()
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "DJANGO_DEBUG": "0",
           "DJANGO_SECRET_KEY": "test-secret-key-not-for-production", name: value}  # fmt: skip
    args = [sys.executable, "-m", "playground.serve", "-b", "127.0.0.1", "-p", str(port)]
    served = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert served.returncode != 0 and "Listening on" not in served.stderr
    last = served.stderr.strip().splitlines()[-1]
    assert name in last and repr(value.split(",")[-1]) in last, served.stderr[-2000:]
    # manage.py too (the image migrates first): the same line, before anything is done
    migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert migrate.returncode != 0 and migrate.stderr.strip().splitlines()[-1] == last
    assert not (tmp_path / "db.sqlite3").exists()


# ---- where the limits are applied --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_the_api_answers_429_with_retry_after_over_the_limit(settings, redis_url, start_worker):
    from django.test import AsyncClient

    from playground import jobs

    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=1, ip_tokens=0, key_requests=0, key_tokens=0)
    start_worker(["standin:1000"])
    body = {"model": "standin:1000", "prompt": "hi", "max_tokens": 2}
    client = AsyncClient()
    first = await client.post("/v1/completions", body, content_type="application/json")
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == "hi"
    second = await client.post("/v1/completions", body, content_type="application/json")
    assert second.status_code == 429 and 1 <= int(second["Retry-After"]) <= 60
    error = second.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert error["message"].startswith("Rate limit reached: 1 requests per minute per IP address")
    await jobs.job_client().r.aclose()


@pytest.mark.django_db(transaction=True)
async def test_the_websocket_answers_an_error_frame_and_charges_tokens(settings, redis_url, start_worker):
    from channels.testing import WebsocketCommunicator

    from playground import jobs
    from playground.asgi import application

    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=0, ip_tokens=10, key_requests=0, key_tokens=0)
    start_worker(["standin:1000"])
    communicator = WebsocketCommunicator(application, "/ws/generate/", headers=SAME_ORIGIN)
    assert (await communicator.connect())[0]

    async def ending(frame: dict) -> dict:
        await communicator.send_json_to({"type": "generate", "model": "standin:1000", **frame})
        while (answer := await communicator.receive_json_from(timeout=20))["type"] not in ("done", "error"):
            pass
        return answer

    assert (await ending({"prompt": "abc", "max_tokens": 12}))["type"] == "done"  # 12 tokens >= the 10
    refused = await ending({"prompt": "abc", "max_tokens": 1})
    assert refused["code"] == "rate_limited" and "10 generated tokens per minute" in refused["message"]
    assert 1 <= refused["retry_after_s"] <= 60
    await communicator.disconnect()
    await jobs.job_client().r.aclose()


@pytest.mark.django_db(transaction=True)
async def test_a_page_that_closes_right_after_asking_is_charged_its_tokens(settings, redis_url, start_worker):
    """Tokens were charged by the socket that saw its job end: closing it at once ran the job for free."""
    from channels.testing import WebsocketCommunicator

    from playground import jobs
    from playground.asgi import application

    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_ORPHAN_GRACE_S = 0.2
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=0, ip_tokens=10, key_requests=0, key_tokens=0)
    start_worker(["standin:1000"])

    async def ask(max_tokens: int) -> tuple[WebsocketCommunicator, dict]:
        communicator = WebsocketCommunicator(application, "/ws/generate/", headers=SAME_ORIGIN)
        assert (await communicator.connect())[0]
        frame = {"type": "generate", "model": "standin:1000", "prompt": "abc", "max_tokens": max_tokens}
        await communicator.send_json_to(frame)
        while (answer := await communicator.receive_json_from(timeout=20))["type"] == "workers":
            pass
        return communicator, answer

    leaving, answer = await ask(max_tokens=12)  # 12 tokens >= the 10
    assert answer["type"] == "queue"
    await leaving.disconnect()  # before its first token
    await asyncio.sleep(2)  # the grace period, and the job's end
    staying, refused = await ask(max_tokens=1)
    assert refused["type"] == "error" and refused["code"] == "rate_limited"
    await staying.disconnect()
    await jobs.job_client().r.aclose()


def test_an_api_client_that_hangs_up_before_the_end_is_charged_its_tokens(start_worker, start_web):
    import httpx

    start_worker(["standin:200"])
    web = start_web(env={"PLAYGROUND_IP_REQUESTS_PER_MIN": "0", "PLAYGROUND_IP_TOKENS_PER_MIN": "10"})
    body = {"model": "standin:200", "prompt": "abc", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", web.url + "/v1/completions", json=body, timeout=20) as stream:
        chunks = stream.iter_lines()
        for _ in range(2 * 20):  # 20 tokens (each chunk is a data line and a blank line)
            next(chunks)
    # it hung up with 20 tokens read, twice its budget: once its job has ended, the next call must wait
    time.sleep(2)
    refused = httpx.post(web.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 1})
    assert refused.status_code == 429 and refused.reason_phrase == "Too Many Requests"  # daphne's status line
    assert refused.json()["error"]["message"].startswith("Rate limit reached: 10 generated tokens per minute")
    assert len(refused.headers["x-request-id"]) == 32  # a refusal is named too


async def test_a_refunded_request_gives_its_place_in_the_budget_back(r):
    rl = limiter(r, ip_requests=2, ip_tokens=10)
    first = await rl.admit("203.0.113.9", now=T0)
    assert first.allowed
    await rl.refund(first)  # the full queue turned it away after all
    assert (await rl.admit("203.0.113.9", now=T0 + 1)).allowed
    assert (await rl.admit("203.0.113.9", now=T0 + 2)).allowed
    assert not (await rl.admit("203.0.113.9", now=T0 + 3)).allowed
    await rl.refund(await rl.admit("203.0.113.9", now=T0 + 4))  # a refusal has nothing to refund


@pytest.mark.django_db(transaction=True)
async def test_a_full_queue_turns_a_request_away_without_spending_its_budget(
    settings, redis_url, start_worker
):
    # A client that honours the queue's Retry-After (1 s) must not run out of requests for asking again.
    from django.test import AsyncClient

    from common.protocol import JobSpec
    from playground import jobs
    from playground.asgi import application

    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_MAX_QUEUE = 1
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=2, ip_tokens=0, key_requests=0, key_tokens=0)
    model = "standin:20"
    start_worker([model])
    client = jobs.job_client()
    # one job running and one waiting: the queue is full
    running = await client.submit(JobSpec(model=model, prompt="r", params={"max_new_tokens": 2000}))
    for _ in range(100):
        if (await client.status(running)).get("status") == "running":
            break
        await asyncio.sleep(0.05)
    waiting = await client.submit(JobSpec(model=model, prompt="w", params={"max_new_tokens": 2000}))

    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    api = AsyncClient()
    for _ in range(3):  # more than the budget's 2
        refused = await api.post("/v1/completions", body, content_type="application/json")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    page = WebsocketCommunicator(application, "/ws/generate/", headers=SAME_ORIGIN)
    assert (await page.connect())[0]

    async def ask() -> dict:
        await page.send_json_to({"type": "generate", "model": model, "prompt": "hi", "max_tokens": 2})
        while (frame := await page.receive_json_from(timeout=20))["type"] not in ("queue", "error"):
            pass
        return frame

    for _ in range(3):
        assert (await ask())["code"] == "queue_full"

    for job_id in (waiting, running):
        await client.cancel(job_id)
    for _ in range(2):  # the whole budget is still there
        answer = await api.post("/v1/completions", body, content_type="application/json")
        assert answer.status_code == 200, answer.json()
    refused = await api.post("/v1/completions", body, content_type="application/json")
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    for _ in range(2):
        assert (await ask())["type"] == "queue"
        while (await page.receive_json_from(timeout=20))["type"] not in ("done", "error"):
            pass
    assert (await ask())["code"] == "rate_limited"
    await page.disconnect()
    await client.r.aclose()


@pytest.mark.django_db(transaction=True)
async def test_a_resume_counts_against_the_request_budget_like_a_generation(
    settings, redis_url, start_worker
):
    from playground import jobs
    from playground.asgi import application

    settings.REDIS_URL = redis_url
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=2, ip_tokens=0, key_requests=0, key_tokens=0)
    start_worker(["standin:1000"])
    page = WebsocketCommunicator(application, "/ws/generate/", headers=SAME_ORIGIN)
    assert (await page.connect())[0]

    async def answer(frame: dict) -> dict:
        await page.send_json_to(frame)
        while True:
            reply = await page.receive_json_from(timeout=30)
            if reply["type"] in ("done", "error"):
                return reply

    done = await answer({"type": "generate", "prompt": "hi", "model": "standin:1000", "max_tokens": 2})
    assert done["type"] == "done"
    assert (await answer({"type": "resume", "job_id": done["job_id"], "after": "0-0"}))["type"] == "done"
    refused = await answer({"type": "resume", "job_id": done["job_id"], "after": "0-0"})
    assert refused["code"] == "rate_limited" and "2 requests per minute" in refused["message"]
    await page.disconnect()
    await jobs.job_client().r.aclose()


async def test_by_default_the_ip_token_budget_is_half_of_what_the_live_workers_were_measured_to_produce(
    r, redis_url, monkeypatch
):
    import redis as sync_redis

    from common.protocol import JobClient, WorkerChannel

    monkeypatch.delenv("PLAYGROUND_IP_TOKENS_PER_MIN")
    config = LimitConfig.from_env()
    assert config.ip_tokens is AUTO
    assert (await RateLimiter(r, config).measured_ip_tokens()) == AUTO_FALLBACK_TOKENS  # nothing measured yet

    sync = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    for worker in ("w1", "w2"):  # two workers of a model measured at 150 tokens/s (~9,000 a minute each)
        WorkerChannel(sync, worker, ["slow-model"]).heartbeat({})
    sync.close()
    await JobClient(r).record_speed("slow-model", {"decode_tok_s": 150.0, "total_ms": 20_000.0})
    limits = RateLimiter(r, config)
    assert await limits.measured_ip_tokens() == 150 * 2 * 60 // 2  # half of the two workers' minute
    assert (await limits.admit("203.0.113.9")).allowed
    await limits.charge_tokens("203.0.113.9", None, 9_000, "one-long-job")
    refused = await limits.admit("203.0.113.9")
    assert not refused.allowed and "9000 generated tokens per minute per IP address" in refused.message
