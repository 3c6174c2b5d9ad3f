"""playground.supervise on its own: a child that keeps dying is started again after a doubling backoff, a start
that fails is tried again later, and the counts reach Redis for /metrics."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis

from playground import supervise
from playground.supervise import RESTARTS_KEY, Child, Supervisor

pytestmark = pytest.mark.timeout(60)


def crashing() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])


def until(supervisor: Supervisor, done, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the supervisor never got there"
        supervisor.check()
        time.sleep(0.02)


def test_a_child_that_keeps_dying_is_restarted_after_a_doubling_backoff(redis_url, capsys):
    supervisor = Supervisor(redis_url)
    child = supervisor.launch(Child("flaky", crashing))
    starts = [time.monotonic()]
    for restarts in (1, 2, 3):
        until(supervisor, lambda n=restarts: child.restarts == n)
        starts.append(time.monotonic())
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
    # each wait at least its backoff (0.5, 1, 2 s): a crash loop does not spin
    assert all(gap >= backoff for gap, backoff in zip(gaps, (0.5, 1.0, 2.0), strict=True)), gaps
    out = capsys.readouterr().out
    assert "flaky exited with code 3; starting it again in 0.5 s" in out
    assert (
        "flaky exited with code 3; starting it again in 2 s" in out and "flaky restarted (restart 3)" in out
    )
    assert redis.Redis.from_url(redis_url).hget(RESTARTS_KEY, "flaky") == b"3"


def test_a_start_that_fails_is_tried_again_and_a_long_run_resets_the_backoff(monkeypatch, capsys):
    monkeypatch.setattr(supervise, "RESTART_RESET_S", 0.3)
    failures, starts = [], []

    def start() -> subprocess.Popen:
        starts.append(1)
        if len(starts) == 2:  # the first restart fails (e.g. redis-server did not answer)
            failures.append(1)
            raise RuntimeError("did not answer")
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])

    supervisor = Supervisor()  # no Redis: the counts are only printed
    child = supervisor.launch(Child("sleeper", start))
    until(supervisor, lambda: len(starts) == 3 and child.due_at is None)
    assert (
        failures == [1]
        and "sleeper did not start (did not answer); trying again in" in capsys.readouterr().out
    )
    until(supervisor, lambda: child.process.poll() is not None)  # it ran past RESTART_RESET_S ...
    until(supervisor, lambda: child.due_at is not None)
    assert (
        child.due_at - time.monotonic() <= supervise.RESTART_FIRST_S
    )  # ... so its next crash waits the least
    child.process.wait()


def test_an_exit_that_a_restart_cannot_mend_ends_the_child_for_good_and_says_so(capsys):
    tidied = []
    supervisor = Supervisor()
    supervisor.launch(Child("worker", crashing, on_exit=lambda: tidied.append(1), final_codes=frozenset({3})))
    until(supervisor, lambda: supervisor.ended is not None)
    assert (
        supervisor.ended == "worker exited with code 3: starting it again would not help; see its line above"
    )
    assert (
        tidied == [1] and supervisor.processes() == {}
    )  # tidied up, and neither restarted nor stopped again
    time.sleep(supervise.RESTART_FIRST_S + 0.1)
    supervisor.check()
    assert supervisor.processes() == {} and "starting it again in" not in capsys.readouterr().out
