"""A job whose prompt is token ids, on a real worker process against the suite's Redis. Its model (tiny-llama)
puts a BOS before a prompt's text; ids are read as given, and the `prefilled` event carries their text."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from common.events import SamplingParams
from common.protocol import JobClient, JobSpec

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def jobs(redis_url):
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield JobClient(r)
    await r.aclose()


async def run_job(jobs: JobClient, spec: JobSpec) -> dict[str, dict]:
    """The job's events until done or error, by type (the last of each)."""
    await jobs.submit(spec)
    events = {}
    async with asyncio.timeout(60):
        async for _, kind, data in jobs.events(spec.id, block_ms=100):
            events[kind] = data
    return events


async def test_ids_are_read_as_given_and_their_text_comes_with_the_prefill(jobs, start_worker):
    from inference.engine import Engine

    start_worker(["bos=tiny-llama"])
    engine = Engine.load("tiny-llama", device="cpu")
    text = "def add(a, b):"
    encoded = engine.tokenizer.encode_text(text)
    assert encoded[0] == engine.tokenizer.bos_id  # what the worker would read for the text
    params = {"max_new_tokens": 4, "temperature": 0}

    given = encoded[1:]  # no BOS: none is added
    events = await run_job(jobs, JobSpec(model="bos", prompt_ids=given, params=params))
    assert events["prefilled"]["prompt"] == text and events["prefilled"]["prompt_tokens"] == len(given)
    assert events["done"]["stats"]["prompt_tokens"] == len(given)
    local = list(engine.generate(given, SamplingParams(**params)))
    assert events["done"]["text"] == local[-1].text

    # the text itself: its BOS, and no text in the prefill (the web has it already)
    events = await run_job(jobs, JobSpec(model="bos", prompt=text, params=params))
    assert events["prefilled"]["prompt_tokens"] == len(encoded) and "prompt" not in events["prefilled"]


async def test_an_id_past_the_vocabulary_is_refused_and_the_worker_serves_on(jobs, start_worker):
    start_worker(["bos=tiny-llama"])  # its tokenizer has ids 0 to 1023
    events = await run_job(jobs, JobSpec(model="bos", prompt_ids=[5, 1024], params={"max_new_tokens": 2}))
    assert events["error"] == {
        "code": "invalid_request",
        "param": "prompt",
        "message": "prompt: token ids must be integers in [0, 1024) (the model's vocabulary), got 1024",
    }
    events = await run_job(jobs, JobSpec(model="bos", prompt_ids=[5, 1023], params={"max_new_tokens": 2}))
    assert events["done"]["stats"]["prompt_tokens"] == 2
