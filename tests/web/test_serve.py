"""The web process's launcher (playground.serve): daphne takes every websocket message the consumer's frame limit
allows, so a long prompt the playground accepts reaches the consumer instead of cutting the connection."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import websockets
from django.core.exceptions import ImproperlyConfigured

from common.redis_server import free_port
from playground.serve import APPLICATION, DAPHNE_DEFAULT_MESSAGE_BYTES, daphne_args
from playground.settings import env_number, redis_url
from tests.support import ROOT

pytestmark = pytest.mark.timeout(120)


def test_daphne_takes_the_frame_limit_with_headroom_and_never_less_than_its_default():
    limit = str(2_000_000 + 64 * 1024)
    assert daphne_args(["-p", "8000"], 2_000_000) == [
        "-p", "8000", "--websocket-max-message-size", limit, "--websocket-max-frame-size", limit, APPLICATION
    ]  # fmt: skip
    small = daphne_args([], 100_000)
    assert small[small.index("--websocket-max-frame-size") + 1] == str(DAPHNE_DEFAULT_MESSAGE_BYTES)
    # an operator's own value wins
    given = daphne_args(["--websocket-max-message-size=5000000"], 2_000_000)
    assert given == ["--websocket-max-message-size=5000000", "--websocket-max-frame-size", limit, APPLICATION]


async def answer(ws) -> dict:
    while True:
        frame = json.loads(await ws.recv())
        if frame["type"] != "workers":
            return frame


async def test_a_prompt_past_a_mebibyte_reaches_the_consumer(start_web):
    # 300,000 four-byte characters: 1.2 MB as a browser's JSON.stringify sends them, past daphne's own 1 MiB
    web = start_web(env={"PLAYGROUND_MAX_PROMPT_CHARS": "400000"})  # frames up to 4 x 400,000 + 64 KiB
    url = web.url.replace("http://", "ws://") + "/ws/generate/"
    async with websockets.connect(url, origin=web.url, open_timeout=20) as ws:
        frame = {"type": "generate", "prompt": "\U0001f600" * 300_000, "model": "nope"}
        await ws.send(json.dumps(frame, ensure_ascii=False))
        got = await answer(ws)
        assert got["type"] == "error" and got["code"] == "invalid_request" and got["param"] == "model", got
        # past the consumer's limit: its own clear error, and the socket stays open
        await ws.send("x" * (4 * 400_000 + 64 * 1024 + 1))
        got = await answer(ws)
        assert got["type"] == "error" and got["code"] == "frame_too_large", got
        await ws.send("[]")
        assert (await answer(ws))["code"] == "bad_frame"


def launch(env: dict, tmp_path) -> subprocess.CompletedProcess:
    """`python -m playground.serve` as the image and `make run` start it, with `env` on top of a sound one."""
    port = free_port()
    full = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "DJANGO_DEBUG": "0",
            "DJANGO_SECRET_KEY": "test-secret-key-not-for-production", **env}  # fmt: skip
    args = [sys.executable, "-m", "playground.serve", "-b", "127.0.0.1", "-p", str(port)]
    return subprocess.run(args, cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "name, value, takes",
    [
        ("PLAYGROUND_MAX_QUEUE", "lots", "a whole number of jobs, 0 or more"),
        ("PLAYGROUND_MAX_NEW_TOKENS", "8k", "a whole number of tokens, 1 or more"),
        ("PLAYGROUND_MAX_PROMPT_CHARS", "0", "a whole number of characters, 1 or more"),
        ("PLAYGROUND_MAX_FRAME_BYTES", "1e6", "a whole number of bytes, 1 or more"),
        ("PLAYGROUND_REDIS_CONNECTIONS", "-5", "a whole number of connections, 1 or more"),
        ("PLAYGROUND_ORPHAN_GRACE_S", "15s", "a number of seconds, 0 or more"),
        ("PLAYGROUND_RETENTION_DAYS", "a month", "a whole number of days, 0 or more (0 keeps them all)"),
        (
            "PLAYGROUND_READY_TIMEOUT_S",
            "10s",
            "a number of seconds, greater than 0",
        ),  # was: every request a 500
        ("REDIS_URL", "127.0.0.1:6379", "redis://host:port/db"),
    ],
)
def test_a_bad_setting_stops_the_web_process_at_its_start_with_one_line_naming_it(
    name, value, takes, tmp_path
):
    result = launch({name: value}, tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert name in last and takes in last and repr(value) in last, result.stderr[-2000:]
    assert "Listening on" not in result.stderr + result.stdout  # daphne never served


def test_models_the_workers_would_refuse_stop_the_web_process_too(tmp_path):
    # two folders the page would offer as one model, and a worker would refuse: refused at the web's start too
    result = launch({"MODELS": "/runs/a/checkpoint-500,/runs/b/checkpoint-500"}, tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith(
        "MODELS: '/runs/a/checkpoint-500' and '/runs/b/checkpoint-500' would both be served as "
        "'checkpoint-500': give one another name with name=path (e.g. checkpoint-500-2=/runs/b/checkpoint-500), "
        "or rename a folder"
    ), result.stderr[-2000:]
    assert "Listening on" not in result.stderr + result.stdout


def test_a_bad_redis_urls_password_never_reaches_the_log(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://:hunter2/x@redis:6379/0")  # a "/" in the password, not encoded
    with pytest.raises(ImproperlyConfigured) as info:
        redis_url()
    assert (
        "REDIS_URL" in str(info.value)
        and "hunter2" not in str(info.value)
        and "percent-encode" in str(info.value)
    )
    for good in ("redis://:s3cret@redis:6379/0", "rediss://u:p@host:6380/1", "unix:///run/redis.sock"):
        monkeypatch.setenv("REDIS_URL", good)
        assert redis_url() == good
    monkeypatch.setenv("REDIS_URL", "")
    assert redis_url() == "redis://127.0.0.1:6379/0"  # empty, as unset (make run starts its own then)


def test_numbers_from_the_environment_take_their_defaults_and_bounds(monkeypatch):
    monkeypatch.delenv("PLAYGROUND_TEST_N", raising=False)
    assert env_number("PLAYGROUND_TEST_N", 7) == 7
    monkeypatch.setenv("PLAYGROUND_TEST_N", " 12 ")
    assert env_number("PLAYGROUND_TEST_N", 7) == 12
    monkeypatch.setenv("PLAYGROUND_TEST_N", "0.5")
    assert env_number("PLAYGROUND_TEST_N", 1.0, float, above=True) == 0.5
    for wrong, kwargs in [("0", {"kind": float, "above": True}), ("nan", {"kind": float}), ("inf", {"kind": float}),
                          ("1.5", {}), ("-1", {}), ("3", {"low": 4})]:  # fmt: skip
        monkeypatch.setenv("PLAYGROUND_TEST_N", wrong)
        with pytest.raises(ImproperlyConfigured, match=f"PLAYGROUND_TEST_N: must be .*, got '{wrong}'"):
            env_number("PLAYGROUND_TEST_N", 1, **kwargs)
