"""Shared fixtures: a real Redis server the suite starts on a free port, and real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from inference.protocol import worker_key
from inference.redis_server import start_redis

ROOT = Path(__file__).resolve().parents[1]
# The model every end-to-end test runs: the shipped default model (a tiny synthetic preset until it exists).
E2E_MODEL = os.environ.get("KOG_TEST_MODEL", "")
# A websocket handshake from a page of the site itself, as a browser sends it to an in-process communicator.
SAME_ORIGIN = [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]


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


def e2e_model() -> str:
    if E2E_MODEL:
        return E2E_MODEL
    from inference.engine import DEFAULT_MODEL

    return str(DEFAULT_MODEL)


class WorkerProcess:
    """`python -m inference.worker` as a real subprocess, logging to a file the test can read."""

    def __init__(self, redis_url: str, models: list[str], log_path: Path, env: dict | None = None):
        self.redis_url = redis_url
        self.worker_id = f"test-worker-{os.getpid()}-{time.monotonic_ns()}"
        args = [
            sys.executable,
            "-m",
            "inference.worker",
            "--redis-url",
            redis_url,
            "--worker-id",
            self.worker_id,
        ]
        for model in models:
            args += ["--model", model]
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "KOG_DEVICE": "cpu", **(env or {})}
        self.process = subprocess.Popen(
            args, cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout_s: float = 120) -> dict:
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited ({self.process.returncode}):\n{self.log_path.read_text()}")
            beat = client.get(worker_key(self.worker_id))
            if beat:
                return json.loads(beat)
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready after {timeout_s} s:\n{self.log_path.read_text()}")

    def kill(self) -> None:
        """SIGKILL: the crash case, no goodbye."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


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


class WebServer:
    """daphne serving playground.asgi on a free port, against the suite's Redis and a fresh SQLite file."""

    def __init__(self, redis_url: str, tmp_path: Path, env: dict | None = None):
        from inference.redis_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "REDIS_URL": redis_url,
            "DATABASE_URL": f"sqlite:///{tmp_path / 'web.sqlite3'}",
            "DJANGO_DEBUG": "0",
            "DJANGO_SECRET_KEY": "test-secret-key-not-for-production",
            "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
            **(env or {}),
        }
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=self.env,
                       check=True, capture_output=True)  # fmt: skip
        self.log_path = tmp_path / f"daphne-{self.port}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        args = [
            sys.executable,
            "-m",
            "playground.serve",  # daphne, as make run and the image start it
            "-b",
            "127.0.0.1",
            "-p",
            str(self.port),
        ]
        self.process = subprocess.Popen(
            args, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self._wait()

    def _wait(self, timeout_s: float = 60) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daphne exited ({self.process.returncode}):\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"daphne not serving after {timeout_s} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


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
# the limits set their own (tests/test_limits.py, test_security_browser.py).
os.environ.setdefault("PLAYGROUND_IP_REQUESTS_PER_MIN", "1000000")
os.environ.setdefault("PLAYGROUND_IP_TOKENS_PER_MIN", "1000000000")


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


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
    """A page of its own context (tests/page_testing.py's new_page), closed after the test; a module with its
    own needs (test_browser.py's dialogs, test_security_browser.py's console) defines its own."""
    from tests.page_testing import new_page  # page_testing imports this module

    page = new_page(browser)
    yield page
    page.context.close()
