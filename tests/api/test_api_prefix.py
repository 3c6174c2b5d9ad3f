"""Prefix reuse seen through the API with the official client: the second of two requests that share a long
prefix reports the shared tokens as cached (OpenAI's usage.prompt_tokens_details.cached_tokens, llama.cpp's
timings.cache_n) and prefills only the rest."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import redis

from tests.support import WebServer, WorkerProcess, e2e_model


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    redis.Redis.from_url(redis_server).flushall()
    tmp = tmp_path_factory.mktemp("api_prefix")
    worker = WorkerProcess(redis_server, [e2e_model()], tmp / "worker.log")
    web = None
    try:
        model = worker.wait_ready()["models"][0]
        web = WebServer(redis_server, tmp)
        yield web, model
    finally:
        if web is not None:
            web.stop()
        worker.stop()


# a long shared beginning, as an agent's system prompt and its earlier turns are
SHARED = "".join(f"def step_{i}(state):\n    return state + {i}\n\n" for i in range(60))


def completion(web: WebServer, model: str, prompt: str) -> tuple[dict, dict]:
    """(usage, timings) of a non-streamed completion; timings is a field OpenAI's client keeps as an extra."""
    client = openai.OpenAI(base_url=f"{web.url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    return reply.usage, reply.model_extra["timings"]


def test_a_request_sharing_a_long_prefix_reports_it_cached_and_prefills_less(stack):
    web, model = stack
    first, first_timings = completion(web, model, SHARED + "def first(x):\n")
    assert first.prompt_tokens > 500
    second, timings = completion(web, model, SHARED + "def second(y):\n    return y * 2\n")
    cached = second.prompt_tokens_details.cached_tokens
    assert 500 < cached < second.prompt_tokens
    assert timings["cache_n"] == cached and timings["prompt_n"] == second.prompt_tokens - cached
    # a prefill of a few dozen tokens against one of several hundred: far apart, not a close timing call
    assert timings["prompt_ms"] < first_timings["prompt_ms"]


def test_streamed_usage_reports_the_cached_tokens_too(stack):
    web, model = stack
    prompt = SHARED + "def third(z):\n"
    completion(web, model, prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{web.url}/v1/completions", json=body, timeout=120) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    usage = [json.loads(line)["usage"] for line in lines[:-1] if json.loads(line).get("usage")]
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == usage[-1]["prompt_tokens"] - 1
