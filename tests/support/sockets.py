"""The page's websocket protocol driven without a browser: for tests that break processes under a run."""

from __future__ import annotations

import asyncio
import json

import websockets


class PageSocket:
    """One websocket of the page's protocol, keeping every job frame it receives (not the workers frames)."""

    def __init__(self, ws):
        self.ws = ws
        self.frames: list[dict] = []

    @classmethod
    async def open(cls, web_url: str, address: str | None = None) -> PageSocket:
        """`address`: the loopback address (127.0.0.2, ...) the socket comes from, as a second visitor's."""
        ws_url = web_url.replace("http://", "ws://") + "/ws/generate/"
        local = {"local_addr": (address, 0)} if address else {}
        return cls(await websockets.connect(ws_url, origin=web_url, open_timeout=20, **local))

    async def send(self, **frame) -> None:
        await self.ws.send(json.dumps(frame))

    async def generate(self, prompt: str, max_tokens: int, model: str) -> None:
        await self.send(type="generate", prompt=prompt, model=model, max_tokens=max_tokens)

    async def until(self, kinds: tuple[str, ...], timeout_s: float) -> dict:
        """The next frame of one of `kinds` (the frames before it kept too)."""
        async with asyncio.timeout(timeout_s):
            while True:
                frame = json.loads(await self.ws.recv())
                if frame["type"] != "workers":
                    self.frames.append(frame)
                if frame["type"] in kinds:
                    return frame

    def text(self) -> str:
        return "".join(f["text"] for f in self.frames if f["type"] == "delta")

    def last_id(self) -> str:
        return [f["id"] for f in self.frames if f.get("id")][-1]
