"""make run's launcher keeps the playground up: a worker, Redis or daphne killed with SIGKILL is started
again, the clients of a lost job are told, the next request is served, and /metrics counts the restarts."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.support.launcher import Output, child_named, ctrl_c, launched
from tests.support.sockets import PageSocket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLOW = "standin:50"  # 50 tokens/s: a 2,000-token run lasts 40 s, long enough to kill its worker under it


def wait_for_child(launcher, words: bytes, other_than: int | None, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = child_named(launcher, words)
        if pid is not None and pid != other_than:
            return pid
        time.sleep(0.1)
    raise AssertionError(f"no new {words!r} within {timeout_s} s")


def completion(url: str, prompt: str) -> dict:
    body = json.dumps({"model": SLOW, "prompt": prompt, "max_tokens": 3}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)


def served_within(url: str, prompt: str, since: float, bound_s: float) -> float:
    """Seconds from `since` until a completion is served, asking again while the playground recovers (a
    refused connection, a 503); fails past `bound_s`."""
    while True:
        try:
            assert completion(url, prompt)["choices"][0]["text"] == prompt * 3  # the stand-in repeats it
            return time.monotonic() - since
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if time.monotonic() - since > bound_s:
                raise AssertionError(f"not served within {bound_s} s of the kill: {exc}") from None
            time.sleep(0.2)


def restarts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    prefix = 'kog_process_restarts{process="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.split()[-1])
        for line in lines
        if line.startswith(prefix)
    }


async def test_a_killed_worker_redis_or_daphne_is_restarted_and_the_next_request_served(tmp_path):
    with launched(tmp_path, "--model", SLOW) as (launcher, port):
        url = f"http://127.0.0.1:{port}"
        output = Output(launcher)
        output.wait_for("Playground: http://", timeout_s=120)

        # the worker, three times in a row: its running client hears worker_lost, a new worker serves next
        client = await PageSocket.open(url)
        killed: set[str] = set()
        for round_ in range(3):
            await client.generate("abc", max_tokens=2000, model=SLOW)
            started = await client.until(("started",), timeout_s=60)
            await client.until(("delta",), timeout_s=20)
            killed.add(started["worker"])
            os.kill(child_named(launcher, b"inference.worker"), signal.SIGKILL)
            killed_at = time.monotonic()
            lost = await client.until(("error", "done"), timeout_s=30)
            told_s = time.monotonic() - killed_at
            assert lost["type"] == "error" and lost["code"] == "worker_lost", lost
            assert told_s < 5, f"worker_lost came {told_s:.1f} s after the kill"
            await client.generate(f"next{round_}", max_tokens=5, model=SLOW)
            served = await client.until(("started",), timeout_s=60)
            assert served["worker"] not in killed  # a restarted worker, under an id of its own
            done = await client.until(("done", "error"), timeout_s=30)
            assert done["type"] == "done" and done["text"] == f"next{round_}"[:5], done
            print(f"\nworker kill {round_ + 1}: worker_lost after {told_s:.2f} s")
        await client.ws.close()

        # Redis: the worker and daphne ride it out; the next request is served within 15 s
        redis_pid = child_named(launcher, b"redis-server")
        os.kill(redis_pid, signal.SIGKILL)
        print(f"redis kill: served after {served_within(url, 'r', time.monotonic(), 15):.2f} s")
        assert child_named(launcher, b"redis-server") not in (None, redis_pid)

        # daphne
        daphne_pid = child_named(launcher, b"playground.serve")
        os.kill(daphne_pid, signal.SIGKILL)
        print(f"daphne kill: served after {served_within(url, 'd', time.monotonic(), 15):.2f} s")

        assert restarts(url) == {"redis": 1, "daphne": 1, "worker": 3}
        assert output.text().count("worker exited with code -9; starting it again") == 3, output.text()
        rest = ctrl_c(launcher)
    assert launcher.returncode == 0, output.text() + rest
