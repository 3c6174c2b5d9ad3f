"""Shared fixtures: a real Redis server the suite starts on a free port, and real worker processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from common.redis_server import start_redis
from tests.support import CHROMIUM, CHROMIUM_ARGS, WebServer, WorkerProcess, e2e_model
from tests.support import kernels as _kernels  # noqa: F401  sets Triton's interpreter switch before any import of triton


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server):
    """The suite's Redis, emptied before each test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture
def start_worker(redis_url, tmp_path):
    """Factory: start_worker(models=None, env=None) -> a ready WorkerProcess; all stopped at teardown."""
    started: list[WorkerProcess] = []

    def start(models: list[str] | None = None, env: dict | None = None, wait: bool = True) -> WorkerProcess:
        log_path = tmp_path / f"worker-{len(started)}.log"
        worker = WorkerProcess(redis_url, models or [e2e_model()], log_path, env)
        started.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def start_web(redis_url, tmp_path):
    """Factory: start_web(env=None) -> a serving WebServer (daphne subprocess); stopped at teardown."""
    started: list[WebServer] = []

    def start(env: dict | None = None) -> WebServer:
        server = WebServer(redis_url, tmp_path, env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# Settings refuse to start without a secret key when DEBUG is off (production's default); the
# suite's own processes get this one. Set here, before pytest-django imports the settings.
os.environ.setdefault("DJANGO_SECRET_KEY", "test-secret-key-not-for-production")
# Every test client comes from 127.0.0.1 and the suite's Redis lives for the whole session, so the
# public demo's per-IP budgets would run out across tests: they are raised here, and the tests of
# the limits set their own (tests/web/test_limits.py, test_security_browser.py).
os.environ.setdefault("PLAYGROUND_IP_REQUESTS_PER_MIN", "1000000")
os.environ.setdefault("PLAYGROUND_IP_TOKENS_PER_MIN", "1000000000")
# the same for the fair share per visitor (tests/web/test_fairness.py sets its own)
os.environ.setdefault("PLAYGROUND_MAX_JOBS_PER_VISITOR", "0")
os.environ.setdefault("PLAYGROUND_MAX_SOCKETS_PER_IP", "0")


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by playwright (never `playwright install`); `make test` installs it.

    Module scope, not session: playwright's sync API keeps an event loop running in this thread until
    it stops, and the asyncio tests of later modules need the thread free of it."""
    if not Path(CHROMIUM).exists():
        message = "Debian's chromium is missing: apt-get install -y chromium (make test does it as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A page of its own context (tests/support/page.py's new_page), closed after the test; a module with its
    own needs (test_browser.py's dialogs, test_security_browser.py's console) defines its own."""
    from tests.support.page import new_page

    page = new_page(browser)
    yield page
    page.context.close()
