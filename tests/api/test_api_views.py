"""The API views' pieces that a live client cannot reach on purpose: timings arithmetic, worker error
mapping, and the safety net for a client that leaves before its stream's first chunk."""

import asyncio
import contextlib
import json

import pytest
import redis.asyncio as aioredis
from django.test import AsyncClient

from common.protocol import JobSpec, cancel_key, events_key, queue_key
from playground.api.views import (
    JobRun,
    TextOffsets,
    choices_usage,
    job_error,
    openai_logprobs,
    timings,
    usage,
)
from playground.jobs import job_client

STATS = {"prompt_tokens": 40, "completion_tokens": 11, "prefill_ms": 20.0, "ttft_ms": 25.0, "total_ms": 120.0}


def test_timings_follow_llama_cpp_and_add_ttft_and_queue():
    assert timings(STATS, queue_ms=7.5) == {
        "cache_n": 0,
        "prompt_n": 40,
        "prompt_ms": 20.0,
        "prompt_per_second": 2000.0,
        "predicted_n": 11,
        "predicted_ms": 100.0,
        "predicted_per_second": 110.0,
        "draft_n": 0,
        "draft_n_accepted": 0,
        "decode_steps": 10,
        "ttft_ms": 25.0,
        "queue_ms": 7.5,
    }
    instant = timings({**STATS, "prefill_ms": 0.0, "total_ms": 0.0}, queue_ms=0.0)
    assert instant["prompt_per_second"] == instant["predicted_per_second"] == 0.0  # no division by zero


def test_cached_prompt_tokens_are_cache_n_and_left_out_of_the_prefill_rate():
    cached = timings({**STATS, "cached_tokens": 36}, queue_ms=0.0)
    assert (cached["cache_n"], cached["prompt_n"], cached["prompt_per_second"]) == (36, 4, 200.0)
    assert usage({**STATS, "cached_tokens": 36}) == {
        "prompt_tokens": 40,
        "completion_tokens": 11,
        "total_tokens": 51,
        "prompt_tokens_details": {"cached_tokens": 36},
    }


def test_a_predictions_drafts_are_in_the_usage_and_summed_over_choices():
    with_prediction = {
        **STATS,
        "prediction_tokens": 30,
        "prediction_draft_n": 12,
        "prediction_draft_n_accepted": 9,
    }
    details = {"accepted_prediction_tokens": 9, "rejected_prediction_tokens": 3}
    assert usage(with_prediction)["completion_tokens_details"] == details
    assert "completion_tokens_details" not in usage(STATS)  # no prediction: nothing to count
    both = choices_usage(
        [usage(with_prediction), usage({**with_prediction, "prediction_draft_n_accepted": 12})]
    )
    assert both["completion_tokens_details"] == {
        "accepted_prediction_tokens": 21,
        "rejected_prediction_tokens": 3,
    }
    assert both["completion_tokens"] == 2 * STATS["completion_tokens"]


@pytest.mark.parametrize(
    "event, status, param",
    [
        ({"code": "invalid_request", "param": "prompt", "message": "prompt: too long"}, 400, "prompt"),
        ({"code": "worker_lost", "message": "lost its worker"}, 503, None),
        # lost to a restart of the queue or a stuck worker, or its record gone: the same request can pass later
        ({"code": "queue_restarted", "message": "please run it again"}, 503, None),
        ({"code": "stalled", "message": "please try again"}, 503, None),
        ({"code": "unknown_job", "message": "no such job"}, 503, None),
        ({"code": "internal_error", "message": "RuntimeError: x"}, 500, None),
        ({}, 500, None),
    ],
)
def test_worker_errors_become_http_errors(event, status, param):
    error = job_error(event)
    assert error.status == status
    assert error.body["error"]["param"] == param and error.body["error"]["message"]


@pytest.fixture
def queue(redis_url, settings):
    settings.REDIS_URL = redis_url
    return aioredis.Redis.from_url(redis_url, decode_responses=True)


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_stream_never_started_cancels_its_job(queue, streaming):
    spec = JobSpec(model="m", prompt="p")
    await job_client().submit(spec)
    run = JobRun(spec, ip="127.0.0.1", key_id=None)
    run.streaming = streaming
    run.cancel_unless_streaming_within(0.01)
    await asyncio.sleep(0.3)
    assert await queue.exists(cancel_key(spec.id)) == (not streaming)


async def test_a_cancel_swallowed_below_us_still_stops_the_run(queue):
    spec = JobSpec(model="m", prompt="p")
    await job_client().submit(spec)
    await queue.xadd(events_key(spec.id), {"type": "delta", "data": json.dumps({"text": "x"})})
    run = JobRun(spec, ip="127.0.0.1", key_id=None)

    async def client_that_left():
        asyncio.current_task().cancel()
        with contextlib.suppress(asyncio.CancelledError):  # as 3.11's wait_for inside redis-py may do
            await asyncio.sleep(1)
        return await run.next()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(client_that_left())


@pytest.mark.django_db
async def test_a_full_queue_is_a_429_with_a_retry_after(queue, settings, redis_url):
    import redis

    from common.protocol import WorkerChannel
    from playground.limits import LimitConfig

    settings.PLAYGROUND_MAX_QUEUE = 1
    settings.PLAYGROUND_MODELS = ["m"]
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=0, ip_tokens=0, key_requests=0, key_tokens=0)
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    WorkerChannel(sync, "busy-worker", ["m"]).heartbeat({"job": "another"})  # up, and taking nothing
    await job_client().submit(JobSpec(model="m", prompt="waits"))  # the queue's one place
    body = json.dumps({"model": "m", "prompt": "one too many", "max_tokens": 2})
    response = await AsyncClient().post("/v1/completions", data=body, content_type="application/json")
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    assert json.loads(response.content)["error"]["code"] == "queue_full"
    sync.close()


@pytest.mark.django_db
async def test_template_variables_go_only_to_a_worker_that_renders_them(queue, settings, redis_url):
    import redis

    from common.protocol import WorkerChannel
    from playground.limits import LimitConfig

    settings.PLAYGROUND_MODELS = ["m"]
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=0, ip_tokens=0, key_requests=0, key_tokens=0)
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    # a worker from before chat_template_kwargs: its heartbeat does not say it renders them (it would drop them)
    WorkerChannel(sync, "older-worker", ["m"]).heartbeat({"model_info": {"m": {"chat": True}}})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    response = await AsyncClient().post("/v1/chat/completions", data=body, content_type="application/json")
    error = json.loads(response.content)["error"]
    assert response.status_code == 400 and error["param"] == "chat_template_kwargs", error
    assert "no worker of this model renders them" in error["message"]
    sync.close()


@pytest.mark.django_db
async def test_a_body_nested_too_deeply_is_a_400_that_does_not_count_against_the_rate_limit(
    queue, settings, redis_url
):
    import redis

    from common.protocol import WorkerChannel
    from playground.limits import LimitConfig

    settings.PLAYGROUND_MODELS = ["m"]
    settings.PLAYGROUND_LIMITS = LimitConfig(ip_requests=1, ip_tokens=0, key_requests=0, key_tokens=0)
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    WorkerChannel(sync, "w", ["m"]).heartbeat({"model_info": {"m": {"chat": True, "template_kwargs": True}}})
    deep = "[" * 900 + "]" * 900
    for nested in (f'{{"deep": {deep}}}', "[" * 5000 + "]" * 5000):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        body = body[:-1] + f', "chat_template_kwargs": {nested}}}' if nested.startswith("{") else nested
        response = await AsyncClient().post(
            "/v1/chat/completions", data=body, content_type="application/json"
        )
        error = json.loads(response.content)["error"]
        assert response.status_code == 400 and error["code"] == "invalid_json", error
        assert "nest" in error["message"]
    # the one request a minute this address has is still there
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    task = asyncio.ensure_future(
        AsyncClient().post("/v1/chat/completions", data=body, content_type="application/json")
    )
    for _ in range(100):  # queued: no worker takes it, so the request is admitted and waits
        if await queue.llen(queue_key("m")):
            break
        await asyncio.sleep(0.05)
    assert await queue.llen(queue_key("m")) == 1
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    sync.close()


def test_a_token_the_tokenizer_added_takes_no_characters_of_an_echo():
    def entry(token: str, logprob: float | None, **extra) -> dict:
        return {
            "id": 0,
            "token": token,
            "bytes": list(token.encode()),
            "logprob": logprob,
            "top": [],
            **extra,
        }

    # a BOS, then the prompt "def f" in two tokens, then a reply token: text "def f():"
    entries = [entry("<s>", None, special=True), entry("def", -1.0), entry(" f", -2.0), entry("():", -0.5)]
    shaped = openai_logprobs(entries, chat=False)
    assert shaped["tokens"] == ["<s>", "def", " f", "():"]
    assert shaped["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert shaped["text_offset"] == [0, 0, 3, 5]
    assert shaped["top_logprobs"] == [None, None, None, None]  # logprobs: 0 asks for no alternatives


def logprob_entry(raw: bytes, special: bool = False) -> dict:
    entry = {"id": 0, "token": raw.decode(errors="replace"), "bytes": list(raw), "logprob": -1.0, "top": []}
    return {**entry, "special": True} if special else entry


def test_text_offsets_follow_the_text_through_split_characters_and_special_tokens():
    # "é" split over two byte tokens, an end token generated under ignore_eos, then "ok": the text is "aéok"
    entries = [logprob_entry(b"a"), logprob_entry(b"\xc3"), logprob_entry(b"\xa9"),
               logprob_entry(b"<|endoftext|>", special=True), logprob_entry(b"ok")]  # fmt: skip
    offsets = openai_logprobs(entries, chat=False)["text_offset"]
    assert offsets == [0, 1, 1, 2, 2]
    text = "aéok"
    assert [text[o:] for o in offsets] == ["aéok", "éok", "éok", "ok", "ok"]
    # a byte that starts a character nothing finishes is a U+FFFD of its own, before the next token
    entries = [logprob_entry(b"a"), logprob_entry(b"\xed"), logprob_entry(b"idth"), logprob_entry(b"\xc3")]
    assert openai_logprobs(entries, chat=False)["text_offset"] == [0, 1, 2, 6]  # text "a\ufffdidth\ufffd"


def test_byte_fallback_bytes_that_end_no_character_are_a_replacement_each():
    # SentencePiece's decoder shows <0xE2><0x82> before a word as two U+FFFD; byte-level BPE's shows one
    fallback = [{**logprob_entry(b), "byte_fallback": True} for b in (b"\xe2", b"\x82")]
    word = logprob_entry(b" x")
    assert openai_logprobs([*fallback, word], chat=False)["text_offset"] == [0, 0, 2]  # "\ufffd\ufffd x"
    plain = [logprob_entry(b"\xe2"), logprob_entry(b"\x82"), word]
    assert openai_logprobs(plain, chat=False)["text_offset"] == [0, 0, 1]  # "\ufffd x"
    euro = [*fallback, {**logprob_entry(b"\xac"), "byte_fallback": True}, word]
    assert openai_logprobs(euro, chat=False)["text_offset"] == [0, 0, 0, 1]  # "\u20ac x": a whole character


def test_a_stream_counts_text_offsets_on_from_its_earlier_chunks():
    entries = [
        logprob_entry(b"x = "),
        logprob_entry(b"\xe2\x82"),
        logprob_entry(b"\xac"),
        logprob_entry(b"1"),
    ]
    whole = openai_logprobs(entries, chat=False)["text_offset"]
    offsets = TextOffsets()
    chunked = [o for part in ([entries[0], entries[1]], [entries[2]], [entries[3]])
               for o in openai_logprobs(part, chat=False, offsets=offsets)["text_offset"]]  # fmt: skip
    assert chunked == whole == [0, 4, 4, 5]
