"""`python -m playground.run` (what `make run` calls) as a person runs it in a terminal, up to Ctrl-C."""

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from inference.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_the_worker_before_its_redis_and_leaves_nothing_running(tmp_path):
    port = free_port()
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "LOG_FORMAT": "plain"}
    env.pop("REDIS_URL", None)
    # its own process group, as a terminal gives it: Ctrl-C sends SIGINT to every process in that group
    launcher = subprocess.Popen(
        [sys.executable, "-m", "playground.run", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if "Playground: http://" in line:
                break
        assert launcher.poll() is None, "".join(lines)
        started = children(launcher.pid)  # redis-server, daphne and the worker
        assert len(started) == 3, "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as page:
            assert page.status == 200

        os.killpg(launcher.pid, signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, rest
    assert [pid for pid in started if alive(pid)] == []
    # the worker retires its heartbeat on the way out: its Redis must still be up then
    assert "redis unavailable" not in rest and "heartbeat failed" not in rest, rest
