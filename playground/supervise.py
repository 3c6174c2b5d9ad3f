"""Keeping `make run`'s processes up: a child that dies is started again after a backoff.

The backoff doubles from RESTART_FIRST_S up to RESTART_MAX_S while a child keeps dying, and starts over once
it has run for RESTART_RESET_S: a crash now and then is repaired within a second, a crash loop does not spin.
Each restart is logged and the counts are written to Redis (RESTARTS_KEY), where /metrics reads them: the
launcher serves no HTTP of its own, and a Redis that restarted empty gets them again with the next restart.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from common.protocol import PREFIX

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0
RESTARTS_KEY = f"{PREFIX}supervisor:restarts"  # hash: process name -> restarts since the launch
STALL_EXIT_CODE = 75  # the worker's stall watchdog's "restart me" (inference/worker.py; torch-free here)

log = logging.getLogger("playground.supervise")


@dataclass
class Child:
    """One supervised process. `start` starts it and returns it (it may raise: tried again later);
    `on_exit` runs once after it died, before it starts again (e.g. the worker's heartbeat retired). A first
    start that exits with one of `final_codes` (what it was told cannot work) is not restarted: the supervisor's
    `ended` says so, for the launcher to stop on; after a restart the same code may be passing (memory a crashed
    process still held), so it is restarted."""

    name: str
    start: Callable[[], subprocess.Popen]
    on_exit: Callable[[], None] | None = None
    final_codes: frozenset[int] = frozenset()
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    delay_s: float = RESTART_FIRST_S  # the backoff before its next restart
    due_at: float | None = None  # while dead: when it starts again (time.monotonic())


def say(line: str) -> None:
    print(line, flush=True)  # the launcher's terminal: what a person running make run reads


class Supervisor:
    def __init__(self, redis_url: str | None = None):
        self.children: dict[str, Child] = {}
        self.redis_url = redis_url
        self.ended: str | None = None  # why a child exited for good (a final code), once one has

    def launch(self, child: Child) -> Child:
        """Start `child` for the first time (an exception propagates: the launch fails)."""
        child.process = child.start()
        child.started_at = time.monotonic()
        self.children[child.name] = child
        return child

    def processes(self, *names: str) -> dict[str, subprocess.Popen]:
        """The children's current processes (those named, or all), in launch order."""
        return {
            name: child.process
            for name, child in self.children.items()
            if child.process is not None and (not names or name in names)
        }

    def check(self) -> None:
        """One round: notice the children that died, start again those whose backoff is over."""
        for child in list(self.children.values()):
            now = time.monotonic()
            if child.due_at is None:
                code = child.process.poll()
                if code is None:
                    if now - child.started_at > RESTART_RESET_S:
                        child.delay_s = RESTART_FIRST_S  # it ran long enough: its next crash is a new one
                    continue
                self._died(child, code, now)
            elif now >= child.due_at:
                self._restart(child)

    def _died(self, child: Child, code: int, now: float) -> None:
        final = code in child.final_codes and child.restarts == 0
        why = " (a job stalled it)" if child.name == "worker" and code == STALL_EXIT_CODE else ""
        if not final:
            say(f"{child.name} exited with code {code}{why}; starting it again in {child.delay_s:g} s")
        if child.on_exit is not None:
            try:
                child.on_exit()
            except Exception as exc:  # noqa: BLE001 - a restart must not wait on a tidy-up that failed
                say(f"could not tidy up after {child.name}: {exc}")
        if final:
            del self.children[child.name]  # not started again, not stopped again
            self.ended = (
                f"{child.name} exited with code {code}: starting it again would not help; see its line above"
            )
            return
        self._backoff(child, now)

    def _backoff(self, child: Child, now: float) -> None:
        child.due_at = now + child.delay_s
        child.delay_s = min(child.delay_s * 2, RESTART_MAX_S)

    def _restart(self, child: Child) -> None:
        child.restarts += 1
        try:
            child.process = child.start()
        except Exception as exc:  # noqa: BLE001 - e.g. redis-server that did not answer: try again later
            say(f"{child.name} did not start ({exc}); trying again in {child.delay_s:g} s")
            child.process = None
            self._backoff(child, time.monotonic())
            return
        child.started_at, child.due_at = time.monotonic(), None
        say(f"{child.name} restarted (restart {child.restarts})")  # once: the launcher's log is this terminal
        self.publish_counts()

    def publish_counts(self) -> None:
        """Write every child's restart count to Redis for /metrics; best effort (Redis may be the one down)."""
        if self.redis_url is None:
            return
        try:
            client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=1, socket_timeout=1)
            client.hset(RESTARTS_KEY, mapping={name: c.restarts for name, c in self.children.items()})
            client.close()
        except redis.RedisError as exc:
            log.warning("could not record the restart counts: %s", exc)
