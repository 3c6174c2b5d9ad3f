"""The web process's launcher (playground.serve): daphne takes every websocket message the consumer's frame limit
allows, so a long prompt the playground accepts reaches the consumer instead of cutting the connection."""

from __future__ import annotations

import json

import pytest
import websockets

from playground.serve import APPLICATION, DAPHNE_DEFAULT_MESSAGE_BYTES, daphne_args

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
