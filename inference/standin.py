"""A stand-in engine that echoes its prompt back, one character per token, at a fixed rate.

    python -m inference.worker --model standin:5000     # 5,000 tokens/s

No model and no torch: it measures everything after the engine (worker, Redis, websocket, page)
at speeds a real model reaches only on a fast GPU, and it lets tests choose the output text.
The prompt is repeated until max_new_tokens; stop strings are not applied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from common.events import (
    Done,
    Event,
    InvalidRequest,
    Prefilled,
    SamplingParams,
    Stats,
    TextDelta,
    decode_tok_s,
)
from common.names import STANDIN_PREFIX

PREFIX = STANDIN_PREFIX


class StandinTokenizer:
    has_chat_template = False


class StandinEngine:
    device = "cpu"
    dtype = None
    max_context = 1 << 20
    peak_bandwidth_gbs = None
    tokenizer = StandinTokenizer()

    def __init__(self, tokens_per_s: float):
        if not tokens_per_s > 0:
            raise ValueError(f"standin rate must be > 0 tokens/s, got {tokens_per_s}")
        self.tokens_per_s = tokens_per_s
        self.name = f"{PREFIX}{tokens_per_s:g}"

    @classmethod
    def load(cls, model: str) -> StandinEngine:
        rate = model.removeprefix(PREFIX)
        try:
            return cls(float(rate))
        except ValueError:
            raise ValueError(
                f"model {model!r}: expected standin:<tokens per second>, e.g. standin:5000"
            ) from None

    def bytes_per_token(self, context_len: int) -> int:
        return 0

    def encode_prompt(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        chat: bool = False,
        template_kwargs: dict | None = None,  # no template here
    ) -> list[int]:
        if messages:  # echo the last user turn
            prompt = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        return [ord(c) for c in prompt]

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
        extra_stop_ids: frozenset[int] = frozenset(),  # no FIM here: never given
    ) -> Iterator[Event]:
        start = time.perf_counter()
        yield Prefilled(prompt_tokens=len(prompt_ids), prefill_ms=0.0)
        token_times: list[float] = []
        text: list[str] = []
        finish_reason = "length"
        for i in range(params.max_new_tokens):
            if should_stop is not None and should_stop():
                finish_reason = "cancelled"
                break
            # Token i is due at i / rate: sleeping to an absolute schedule keeps the average rate
            # exact even though each sleep overshoots a little.
            wait = start + i / self.tokens_per_s - time.perf_counter()
            if wait > 0.0005:
                time.sleep(wait)
            token = prompt_ids[i % len(prompt_ids)]
            t = time.perf_counter() - start
            token_times.append(t)
            text.append(chr(token))
            yield TextDelta(text=chr(token), token_ids=[token], t=t)
        total_ms = (time.perf_counter() - start) * 1000
        stats = Stats(
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(token_times),
            prefill_ms=0.0,
            ttft_ms=token_times[0] * 1000 if token_times else 0.0,
            decode_tok_s=decode_tok_s(token_times),
            total_ms=total_ms,
            token_times=token_times,
        )
        yield Done(finish_reason, "".join(text), stats, ended_by=finish_reason)
