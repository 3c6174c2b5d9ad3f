"""`python -m playground.run` started as a terminal starts it, and the processes it runs, found by their
command lines (/proc): for the tests of the launcher and of its supervision."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from common.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def launched(tmp_path: Path, *args: str, env: dict | None = None, cwd: Path = ROOT):
    """`python -m playground.run` in its own session, as a terminal runs it (Ctrl-C reaches its whole group),
    from `cwd`, with a Redis of its own unless `env` names one: (launcher, port), killed at the end if still
    running."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "LOG_FORMAT": "plain",
        "PYTHONPATH": str(ROOT),  # this checkout's code, also where `cwd` is another folder
        **(env or {}),
    }
    launcher = subprocess.Popen([sys.executable, "-m", "playground.run", "--port", str(port), *args], cwd=cwd,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
    try:
        yield launcher, port
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def ctrl_c(launcher: subprocess.Popen) -> str:
    """Ctrl-C as a terminal sends it; what the launcher printed until it exited."""
    os.killpg(launcher.pid, signal.SIGINT)
    return launcher.communicate(timeout=60)[0]


def workers(launcher: subprocess.Popen) -> list[int]:
    return [pid for pid in children(launcher.pid) if b"inference.worker" in cmdline(pid)]


def read_until(launcher: subprocess.Popen, words: str, lines: list[str]) -> None:
    for line in launcher.stdout:
        lines.append(line)
        if words in line:
            return
    raise AssertionError(f"{words!r} never came:\n{''.join(lines)}")


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def child_named(launcher: subprocess.Popen, words: bytes) -> int | None:
    """The pid of the launcher's child whose command line holds `words` (None while there is none)."""
    return next((pid for pid in children(launcher.pid) if words in cmdline(pid)), None)


class Output:
    """The launcher's output, read in a thread into `lines` as it comes: a test that does not read it
    would otherwise stop the launcher and its children once the pipe's buffer is full."""

    def __init__(self, launcher: subprocess.Popen):
        import threading

        self.lines: list[str] = []
        self._new = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(launcher,), daemon=True)
        self._thread.start()

    def _read(self, launcher: subprocess.Popen) -> None:
        for line in launcher.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, words: str, timeout_s: float, start: int = 0) -> int:
        """The index of the first line from `start` on that holds `words`, once it comes."""
        with self._new:
            found = self._new.wait_for(
                lambda: next((i + 1 for i in range(start, len(self.lines)) if words in self.lines[i]), 0),
                timeout=timeout_s,
            )
        if not found:
            raise AssertionError(f"{words!r} never came:\n{self.text()}")
        return found - 1
