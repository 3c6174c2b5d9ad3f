"""What the tests share: the repository's root, the model the end-to-end tests run, and the real worker and
daphne processes they start (the fixtures in tests/conftest.py hand these out)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
# The model every end-to-end test runs: the shipped default model (a tiny synthetic preset until it exists).
E2E_MODEL = os.environ.get("KOG_TEST_MODEL", "")
# A websocket handshake from a page of the site itself, as a browser sends it to an in-process communicator.
SAME_ORIGIN = [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]


def e2e_model() -> str:
    if E2E_MODEL:
        return E2E_MODEL
    from inference.engine import DEFAULT_MODEL

    return str(DEFAULT_MODEL)


class LoggedProcess:
    """A subprocess writing to its log file (`self.process`, `self.log`, set by the subclass)."""

    process: subprocess.Popen
    log: IO[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class WorkerProcess(LoggedProcess):
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
        import redis  # here, not at the top: the GPU machine runs the kernel tests without the web's packages

        from common.protocol import worker_key

        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited ({self.process.returncode}):\n{self.log_path.read_text()}")
            beat = client.get(worker_key(self.worker_id))
            if beat and not json.loads(beat).get("loading"):  # a loading worker's beat serves nothing yet
                return json.loads(beat)
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready after {timeout_s} s:\n{self.log_path.read_text()}")

    def kill(self) -> None:
        """SIGKILL: the crash case, no goodbye."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


class WebServer(LoggedProcess):
    """daphne serving playground.asgi on a free port, against the suite's Redis and a fresh SQLite file."""

    def __init__(self, redis_url: str, tmp_path: Path, env: dict | None = None):
        from common.redis_server import free_port

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


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
