"""A bounded load test on loopback: 200 websocket clients at once against a live daphne and one worker.

Every client must end, within a bound, either with its complete output (the stand-in echoes the
prompt, so each client knows its text exactly, and the deltas must add up to it) or with a clear
refusal (a full queue). The queue positions each client saw must never go up.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import pytest
import websockets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "standin:5000"
CLIENTS = 200
MAX_QUEUE = 120  # fewer places than clients: the rest must be told at once that the queue is full
MAX_TOKENS = 24
CLIENT_BOUND_S = 90  # no client may wait longer than this for its ending


@dataclass
class Outcome:
    prompt: str
    ending: dict | None = None
    positions: list = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)


def expected_text(prompt: str) -> str:
    return (prompt * MAX_TOKENS)[:MAX_TOKENS]  # the stand-in: one character per token, repeated


async def one_client(ws_url: str, origin: str, index: int, start: asyncio.Event) -> Outcome:
    outcome = Outcome(prompt=f"<{index:03d}>")
    async with websockets.connect(ws_url, origin=origin, open_timeout=60, close_timeout=5) as ws:
        await start.wait()  # all connected first, then all ask at once
        frame = {"type": "generate", "prompt": outcome.prompt, "model": MODEL, "max_tokens": MAX_TOKENS}
        await ws.send(json.dumps(frame))
        async with asyncio.timeout(CLIENT_BOUND_S):
            while outcome.ending is None:
                frame = json.loads(await ws.recv())
                kind = frame["type"]
                if kind == "queue":
                    outcome.positions.append(frame["position"])
                elif kind == "delta":
                    outcome.text.append(frame["text"])
                elif kind in ("done", "error"):
                    outcome.ending = frame
                if frame.get("id"):
                    outcome.ids.append(frame["id"])
    return outcome


def entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def test_two_hundred_concurrent_clients_complete_or_are_refused_clearly(start_worker, start_web):
    start_worker([MODEL])
    web = start_web(
        env={
            "PLAYGROUND_MAX_QUEUE": str(MAX_QUEUE),
            "PLAYGROUND_IP_REQUESTS_PER_MIN": str(10 * CLIENTS),  # the limiter runs, and admits all
            "LOG_LEVEL": "WARNING",
        }
    )
    ws_url = web.url.replace("http://", "ws://") + "/ws/generate/"
    start = asyncio.Event()
    clients = [asyncio.create_task(one_client(ws_url, web.url, i, start)) for i in range(CLIENTS)]
    await asyncio.sleep(0.5)
    started = time.monotonic()
    start.set()
    outcomes = await asyncio.gather(*clients)
    elapsed = time.monotonic() - started

    done = [o for o in outcomes if o.ending["type"] == "done"]
    refused = [o for o in outcomes if o.ending["type"] == "error"]
    assert len(done) + len(refused) == CLIENTS
    for o in refused:
        assert o.ending["code"] == "queue_full" and "full" in o.ending["message"], o.ending
    for o in done:
        assert o.ending["finish_reason"] == "length"
        assert o.ending["text"] == expected_text(o.prompt)  # each client got its own text...
        assert "".join(o.text) == o.ending["text"]  # ...and the deltas lost and repeated nothing
        assert [entry_key(i) for i in o.ids] == sorted({entry_key(i) for i in o.ids})
        waiting = [p for p in o.positions if p is not None]
        assert waiting == sorted(waiting, reverse=True), o.positions  # never moved back in line
    # The queue held MAX_QUEUE jobs at most while the worker drained it: at least that many ran.
    assert len(done) >= MAX_QUEUE
    print(f"\n{len(done)} completed, {len(refused)} refused (queue full), all within {elapsed:.1f} s")
