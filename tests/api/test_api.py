"""The OpenAI-compatible API end to end: the official `openai` client against daphne, Redis and real
workers (the E2E model; the stand-in engine where a test needs a generation of known length)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import httpx
import openai
import pytest
import redis

from common.events import SamplingParams, TextDelta
from common.protocol import job_key
from tests.support import ROOT, WebServer, WorkerProcess, e2e_model

STANDIN = "standin:200"  # echoes its prompt at 200 tokens/s: a generation as long as a test needs


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    """One worker with the E2E model and one daphne for the whole module (Redis flushed once)."""
    redis.Redis.from_url(redis_server).flushall()
    tmp = tmp_path_factory.mktemp("api")
    worker = WorkerProcess(redis_server, [e2e_model()], tmp / "worker.log")
    web = None
    try:
        ready = worker.wait_ready()
        # room in the queue for the fifty concurrent clients below (the default turns the 33rd away: 429)
        web = WebServer(redis_server, tmp, env={"PLAYGROUND_MAX_QUEUE": "64"})
        yield SimpleNamespace(web=web, worker=worker, model=ready["models"][0], redis_url=redis_server)
    finally:
        if web is not None:
            web.stop()
        worker.stop()


@pytest.fixture
def standin(stack, tmp_path):
    worker = WorkerProcess(stack.redis_url, [STANDIN], tmp_path / "standin.log")
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def engine(stack):
    """The worker's model loaded here too: usage must equal what our own tokenizer and engine count."""
    from inference.engine import Engine

    return Engine.load(e2e_model(), device="cpu")


def api(web, key: str = "no-key-needed") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=60)


def sse_lines(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# ---- what a client gets ------------------------------------------------------------------------


def test_models_lists_what_the_workers_serve(stack):
    models = api(stack.web).models.list().data
    assert [m.id for m in models] == [stack.model]
    assert models[0].model_extra["max_model_len"] > 0
    assert api(stack.web).models.retrieve(stack.model).id == stack.model


def test_chat_streamed_and_not_agree_with_usage_from_our_tokenizer(stack, engine):
    client = api(stack.web)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    kwargs = {"model": stack.model, "messages": messages, "max_tokens": 12, "temperature": 0}
    reply = client.chat.completions.create(**kwargs)
    text = reply.choices[0].message.content
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")

    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode_chat(messages)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    # the API takes what the request leaves out (a repetition penalty) from the checkpoint's generation_config.json
    advised = {
        k: v for k, v in engine.sampling_defaults.items() if k not in ("max_new_tokens", "temperature")
    }
    local = list(engine.generate(prompt_ids, SamplingParams(max_new_tokens=12, temperature=0, **advised)))[-1]
    assert (text, reply.usage.completion_tokens) == (local.text, local.stats.completion_tokens)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert_timings(reply.model_extra["timings"], reply.usage)

    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason == reply.choices[0].finish_reason
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(
        reply.usage
    )  # the usage chunk comes last
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id != reply.id  # one job per request
    assert_timings(finished[0].model_extra["timings"], reply.usage)


def test_completions_streamed_and_not_agree_with_usage_from_our_tokenizer(stack, engine):
    client = api(stack.web)
    prompt = "import os\n\ndef list_files(path):\n"
    kwargs = {"model": stack.model, "prompt": prompt, "max_tokens": 10, "temperature": 0.8, "seed": 7}
    raw = client.completions.with_raw_response.create(**kwargs)
    reply = raw.parse()
    assert reply.object == "text_completion"
    assert raw.headers["x-request-id"] == reply.id.removeprefix("cmpl-")  # the job's id, as the logs name it
    assert reply.usage.prompt_tokens == len(engine.tokenizer.encode_text(prompt))
    assert_timings(reply.model_extra["timings"], reply.usage)

    database = sqlite3.connect(stack.web.env["DATABASE_URL"].removeprefix("sqlite:///"))
    saved = "SELECT output, source FROM playground_generation WHERE job_id = ?"
    assert database.execute(saved, [reply.id.removeprefix("cmpl-")]).fetchall() == [
        (reply.choices[0].text, "api")
    ]

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == reply.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    assert_timings(chunks[-1].model_extra["timings"], reply.usage)


def test_a_special_tokens_spelling_in_a_prompt_reaches_the_model_as_text(stack, engine):
    # Read as the model's end-of-text token, this line of code used to end the reply before it began.
    client = api(stack.web)
    prompt = 'EOS = "<|endoftext|>"\n'
    tokenizer = engine.tokenizer
    assert set(tokenizer.encode(prompt)) & tokenizer.eos_ids  # what the spelling would otherwise become
    prompt_ids = tokenizer.encode_text(prompt)
    reply = client.completions.create(model=stack.model, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    # the API takes what the request leaves out (a repetition penalty) from the checkpoint's generation_config.json
    advised = {
        k: v for k, v in engine.sampling_defaults.items() if k not in ("max_new_tokens", "temperature")
    }
    local = list(engine.generate(prompt_ids, SamplingParams(max_new_tokens=8, temperature=0, **advised)))[-1]
    assert (
        reply.choices[0].text == local.text and reply.usage.completion_tokens == local.stats.completion_tokens
    )


def test_stop_strings_cut_the_text_streamed_or_not(stack):
    client = api(stack.web)
    kwargs = {"model": stack.model, "prompt": "def main():\n", "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) >= 6, full
    stop = full[4:6]
    expected = full[: full.find(stop)]
    reply = client.completions.create(**kwargs, stop=[stop, "never there"])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (expected, "stop")
    chunks = client.completions.create(**kwargs, stop=[stop, "never there"], stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_vllms_length_and_stop_fields_through_the_official_client(stack, engine):
    """ignore_eos, stop_token_ids and include_stop_str_in_output (vLLM's, through extra_body) reach the worker: the
    replies are what our own engine gives for the same request."""
    client = api(stack.web)
    advised = {
        k: v for k, v in engine.sampling_defaults.items() if k not in ("max_new_tokens", "temperature")
    }

    def local(prompt: str, **params) -> tuple[list[int], object]:
        events = list(engine.generate(engine.encode_prompt(prompt), SamplingParams(**advised, **params)))
        return [t for e in events if isinstance(e, TextDelta) for t in e.token_ids], events[-1]

    # a prompt whose greedy reply ends with the model's end token before 24 tokens
    candidates = ['if __name__ == "__main__":\n    main()\n', "def f():\n    pass\n", '"""Tests."""\n']
    prompt = next(
        p for p in candidates if local(p, max_new_tokens=24, temperature=0)[1].finish_reason == "stop"
    )
    kwargs = {"model": stack.model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    reply = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    tokens, done = local(prompt, max_new_tokens=24, temperature=0, ignore_eos=True)
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 24) == (
        done.finish_reason, done.stats.completion_tokens)  # fmt: skip
    assert reply.choices[0].text == done.text

    # the request's own stop token: the reply ends with it, its text included
    stop_id = tokens[5]
    reply = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == tokens.index(stop_id) + 1
    assert reply.choices[0].text == local(prompt, max_new_tokens=24, temperature=0, ignore_eos=True,
                                          stop_token_ids=(stop_id,))[1].text  # fmt: skip

    # the stop string kept, streamed or not
    stop = done.text[4:6]
    expected = done.text[: done.text.find(stop) + 2]
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    reply = client.completions.create(**kwargs, stop=[stop], extra_body=body)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (expected, "stop")
    chunks = client.completions.create(**kwargs, stop=[stop], extra_body=body, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected
    # an id past the model's vocabulary: the worker refuses it, and serves on
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(**kwargs, extra_body={"stop_token_ids": [10**9]})
    assert (
        client.completions.create(**kwargs).choices[0].text
        == local(prompt, max_new_tokens=24, temperature=0)[1].text
    )


def test_n_choices_are_the_requests_seeds_in_turn_streamed_or_not(stack):
    """n = 3 sampled with seed 41: choice i is what one request with seed 41 + i replies; the usage counts the
    prompt once and every choice's tokens; streamed, each chunk names its choice and the text is the same."""
    client = api(stack.web)
    kwargs = {"model": stack.model, "prompt": "def parse(line):\n", "max_tokens": 12, "temperature": 1.0}
    singles = [client.completions.create(**kwargs, seed=41 + i) for i in range(3)]
    assert len({one.choices[0].text for one in singles}) > 1  # the seeds draw different replies
    reply = client.completions.create(**kwargs, seed=41, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [one.choices[0].text for one in singles]
    assert [c.finish_reason for c in reply.choices] == [one.choices[0].finish_reason for one in singles]
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(client.completions.create(**kwargs, seed=41, n=3, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert len({c.id for c in chunks}) == 1 and chunks[-1].choices == []
    texts = ["", "", ""]
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in reply.choices]
    assert counts(chunks[-1].usage) == counts(reply.usage)

    # an echo with logprobs: each choice begins with the prompt and lists its tokens, scored as one request's
    echoed = client.completions.create(**kwargs, seed=41, n=2, echo=True, logprobs=1)
    single = client.completions.create(**kwargs, seed=42, echo=True, logprobs=1)
    assert [c.text for c in echoed.choices] == [kwargs["prompt"] + one.choices[0].text for one in singles[:2]]
    assert echoed.choices[1].logprobs.tokens == single.choices[0].logprobs.tokens
    assert echoed.choices[1].logprobs.text_offset == single.choices[0].logprobs.text_offset

    # chat, greedy: the same reply twice
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="n: must be an integer in"):
        client.completions.create(**kwargs, n=9)


def counts(usage) -> tuple[int, int, int]:
    """A usage's token counts; its cached_tokens differ between two runs of one prompt (the second reuses it)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def assert_timings(timings: dict, usage) -> None:
    # prompt_n: the tokens prefilled; cache_n: those an earlier request's KV cache held
    assert timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens
    assert 0 <= timings["cache_n"] < usage.prompt_tokens  # the last prompt token is always prefilled
    assert timings["predicted_n"] == usage.completion_tokens
    for name in ("prompt_ms", "predicted_ms", "ttft_ms", "queue_ms"):
        assert timings[name] >= 0, name
    assert timings["prompt_per_second"] == pytest.approx(timings["prompt_n"] * 1000 / timings["prompt_ms"])
    assert timings["predicted_per_second"] == pytest.approx(
        timings["predicted_n"] * 1000 / timings["predicted_ms"]
    )
    assert timings["ttft_ms"] >= timings["prompt_ms"]  # the first token comes after the prefill
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    # every token after the first came from a step: one each, or one plus the accepted drafts of a verify step
    assert timings["decode_steps"] <= max(timings["predicted_n"] - 1, 0)


def test_timings_count_drafts_on_a_code_edit(stack, engine):
    """A prompt whose answer copies it: the worker speculates (on by default), the timings say how much, and
    the text is the plain greedy decoding's."""
    from inference.bench.workload import WORKLOAD

    prompt = next(p for p in WORKLOAD if p.name == "docstrings").text
    client = api(stack.web)
    # plain greedy, without the repetition penalty the default model recommends (it keeps copies from being drawn)
    reply = client.completions.create(
        model=stack.model, prompt=prompt, max_tokens=48, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    timings = reply.model_extra["timings"]
    assert_timings(timings, reply.usage)
    assert timings["draft_n_accepted"] > 0
    assert timings["decode_steps"] < reply.usage.completion_tokens - 1  # fewer steps than tokens
    local = list(
        engine.generate(
            engine.tokenizer.encode_text(prompt), SamplingParams(max_new_tokens=48, temperature=0)
        )
    )
    assert reply.choices[0].text == local[-1].text


def test_a_prediction_makes_drafts_and_changes_nothing_in_the_reply(stack):
    """OpenAI's Predicted Outputs through the official client: the reply given as its own prediction comes back
    the same in fewer model steps, most of its tokens accepted drafts; a malformed one is refused, naming it."""
    from inference.bench.workload import WORKLOAD

    client = api(stack.web)
    kwargs = {"model": stack.model, "prompt": WORKLOAD[-1].text, "max_tokens": 48, "temperature": 0}
    plain = client.completions.create(**kwargs)
    text = plain.choices[0].text
    predicted = client.completions.create(
        **kwargs, extra_body={"prediction": {"type": "content", "content": text}}
    )
    assert predicted.choices[0].text == text
    before, after = plain.model_extra["timings"], predicted.model_extra["timings"]
    assert after["draft_n_accepted"] > before["draft_n_accepted"]
    assert after["decode_steps"] < before["decode_steps"]
    # OpenAI's usage counts of the prediction: here its drafts the model kept and those it did not
    details = predicted.usage.completion_tokens_details
    assert 0 < details.accepted_prediction_tokens <= after["draft_n_accepted"]
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens <= after["draft_n"]
    assert plain.usage.completion_tokens_details is None
    # chat takes it as a first-class argument of the client, content as text parts too
    chat = {"model": stack.model, "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 24,
            "temperature": 0}  # fmt: skip
    reply = client.chat.completions.create(**chat).choices[0].message.content
    parts = [{"type": "text", "text": reply[:5]}, {"type": "text", "text": reply[5:]}]
    again = client.chat.completions.create(**chat, prediction={"type": "content", "content": parts})
    assert again.choices[0].message.content == reply
    with pytest.raises(openai.BadRequestError, match="prediction"):
        client.chat.completions.create(**chat, prediction={"type": "file", "content": reply})


def test_sse_framing_ends_with_done(stack):
    body = {"model": stack.model, "prompt": "x = ", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{stack.web.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = sse_lines(response)
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    finish_reasons = [json.loads(line)["choices"][0]["finish_reason"] for line in lines[:-1]]
    assert finish_reasons[-1] in ("stop", "length") and not any(finish_reasons[:-1])


# ---- what goes wrong ---------------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_requests_are_openai_errors_and_the_server_stays_up(stack):
    url = f"{stack.web.url}/v1"
    malformed = httpx.post(
        f"{url}/chat/completions",
        content=b'{"model": ',
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert malformed.status_code == 400 and error_of(malformed)["code"] == "invalid_json"

    client = api(stack.web)
    chat = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}]}
    bad = [
        ({**chat, "temperature": -1}, "temperature"),
        ({**chat, "top_p": 1.5}, "top_p"),
        ({**chat, "max_tokens": 0}, "max_tokens"),
        ({**chat, "n": 9}, "n"),
        ({**chat, "messages": []}, "messages"),
        ({**chat, "stop": 3}, "stop"),
    ]
    request_ids = set()  # every refusal is named, as OpenAI's are, for a report to quote
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**body)
        assert info.value.status_code == 400 and info.value.body["param"] == param, body
        assert info.value.body["type"] == "invalid_request_error"
        request_ids.add(info.value.request_id)
    with pytest.raises(openai.NotFoundError) as unknown:  # OpenAI's 404, as GET /v1/models/<id> gives
        client.chat.completions.create(**{**chat, "model": "no-such-model"})
    assert unknown.value.body["code"] == "model_not_found" and unknown.value.body["param"] == "model"
    request_ids.add(unknown.value.request_id)

    assert error_of(httpx.get(f"{url}/embeddings", timeout=10))["code"] == "unknown_url"
    wrong_method = httpx.get(f"{url}/chat/completions", timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    request_ids.add(wrong_method.headers.get("x-request-id"))
    assert error_of(httpx.get(f"{url}/models/nope", timeout=10))["code"] == "model_not_found"
    assert None not in request_ids and len(request_ids) == len(bad) + 2

    reply = client.chat.completions.create(**chat, max_tokens=2)  # still serving
    assert reply.usage.completion_tokens >= 1


def test_fields_that_would_change_the_reply_are_400s_naming_them_and_neutral_ones_pass(stack):
    # what a client written for vLLM or llama.cpp sends through the official client's extra_body
    client = api(stack.web)
    chat = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = [
        {"chat_template_kwargs": {"messages": []}},  # the server's own variable
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        {"n_probs": 3},
        {"dry_multiplier": 0.8},
        {"top_n_sigma": 1.0},
        {"max_token": 5},  # unknown (misspelt): refused as OpenAI refuses it, not dropped
    ]
    for extra in refused:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**chat, extra_body=extra)
        name = next(iter(extra))
        assert info.value.body["param"] == name and name in info.value.body["message"], extra
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=stack.model, prompt="a", max_tokens=1, extra_body={"add_special_tokens": False}
        )
    assert info.value.body["param"] == "add_special_tokens"

    neutral = {"chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False,
               "dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0, "top_n_sigma": -1, "cache_prompt": True}  # fmt: skip
    plain = client.chat.completions.create(**chat, temperature=0)
    reply = client.chat.completions.create(**chat, temperature=0, user="me", store=False, extra_body=neutral)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens  # the same prompt: the template as it is


def test_head_answers_where_get_does_and_only_there(stack):
    with httpx.Client(base_url=f"{stack.web.url}/v1", timeout=10) as http:  # one kept-alive connection
        head = http.head("/models")
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
        assert http.get("/models").json()["data"]  # no stray body was left on the connection
        assert http.head(f"/models/{stack.model}").status_code == 200
        assert (
            http.get(f"/models/{stack.model}/").json()["id"] == stack.model
        )  # a trailing slash is no new id
        post_only = http.head("/chat/completions")
        assert post_only.status_code == 405 and post_only.headers["allow"] == "POST"


def test_bodies_that_crashed_the_view_are_400s_and_the_server_stays_up(stack):
    url = f"{stack.web.url}/v1/chat/completions"
    nested = b"[" * 100_000 + b"]" * 100_000  # json's decoder recurses per level: a RecursionError
    response = httpx.post(url, content=nested, headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"

    with pytest.raises(openai.BadRequestError) as info:  # a role that is no string cannot be a dict key
        api(stack.web).chat.completions.create(
            model=stack.model, messages=[{"role": ["user"], "content": "hi"}], max_tokens=1
        )
    assert info.value.body["param"] == "messages[0].role"
    reply = api(stack.web).completions.create(model=stack.model, prompt="a", max_tokens=1)
    assert reply.usage.completion_tokens == 1


def test_top_p_zero_is_greedy_and_stop_takes_openais_four_sequences(stack):
    client = api(stack.web)
    kwargs = {"model": stack.model, "prompt": "def main():\n", "max_tokens": 8}
    greedy = client.completions.create(**kwargs, temperature=0).choices[0].text
    for seed in (1, 2):  # OpenAI takes top_p=0: only the most likely token is left to draw
        reply = client.completions.create(**kwargs, temperature=1, top_p=0, seed=seed)
        assert reply.choices[0].text == greedy

    four = ["never 1", "never 2", "never 3", "never 4"]
    assert client.completions.create(**kwargs, temperature=0, stop=four).choices[0].text == greedy
    with pytest.raises(openai.BadRequestError) as info:  # more would cost the worker time on every token
        client.completions.create(**kwargs, stop=[*four, "never 5"])
    assert info.value.body["param"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context_is_a_400_streaming_or_not(stack, stream):
    max_context = api(stack.web).models.retrieve(stack.model).model_extra["max_model_len"]
    prompt = "def f(x):\n    return x\n" * (max_context // 2)  # two tokens a line at the least
    refused_before = errors_counted(stack.web, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as info:
        api(stack.web).completions.create(model=stack.model, prompt=prompt, max_tokens=2, stream=stream)
    assert info.value.body["param"] == "prompt" and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # a chat request names its own field
        api(stack.web).chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": prompt}], max_tokens=2, stream=stream
        )
    assert info.value.body["param"] == "messages" and info.value.body["code"] == "context_length_exceeded"
    assert errors_counted(stack.web, "context_length_exceeded") == refused_before + 2  # once each
    still_serving = api(stack.web).completions.create(model=stack.model, prompt="a", max_tokens=1)
    assert still_serving.usage.completion_tokens == 1


def errors_counted(web, kind: str) -> float:
    """kog_errors_total{kind} in the web process's /metrics (one daphne process: its own counters)."""
    for line in httpx.get(f"{web.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'kog_errors_total{{kind="{kind}"}} '):
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_disconnects_frees_the_worker_within_a_second(stack, standin):
    client = api(stack.web)
    stream = client.completions.create(model=STANDIN, prompt="abc", max_tokens=100_000, stream=True)
    chunks = iter(stream)
    job_id = next(chunks).id.removeprefix("cmpl-")
    next(chunks)
    stream.close()  # hang up mid-stream: without a cancel the worker would be busy for 40 s

    reply = client.completions.create(model=STANDIN, prompt="next", max_tokens=1)
    job = redis.Redis.from_url(stack.redis_url, decode_responses=True).hgetall(job_key(job_id))
    assert job["status"] == "cancelled", job
    assert reply.choices[0].text == "n"
    assert reply.model_extra["timings"]["queue_ms"] < 1000, reply.model_extra["timings"]


def test_a_client_that_gives_up_on_a_whole_reply_frees_the_worker_too(stack, standin):
    body = {"model": STANDIN, "prompt": "abc", "max_tokens": 100_000}
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed reply: the view is waiting for `done`
        httpx.post(f"{stack.web.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))

    reply = api(stack.web).completions.create(model=STANDIN, prompt="next", max_tokens=1)
    assert reply.model_extra["timings"]["queue_ms"] < 1000, reply.model_extra["timings"]


def test_a_streamed_chunk_stays_one_line_whatever_the_model_writes(stack, standin):
    """U+0085, U+2028 and U+2029 are text to JSON but line ends to str.splitlines(), and so to httpx's
    iter_lines(): sent as they are, they cut a chunk in two and its JSON no longer parses."""
    prompt = "a\x85b\u2028c\u2029d\re\x1cf é"
    body = {"model": STANDIN, "prompt": prompt, "max_tokens": len(prompt), "stream": True}
    with httpx.stream("POST", f"{stack.web.url}/v1/completions", json=body, timeout=60) as response:
        chunks = [json.loads(line) for line in sse_lines(response)[:-1]]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == prompt


def test_a_prompt_of_token_ids_is_refused_where_no_tokenizer_reads_them(stack, standin):
    # the stand-in engine has none: the web refuses before queueing, as the worker's heartbeat says
    with pytest.raises(openai.BadRequestError) as refused:
        api(stack.web).completions.create(model=STANDIN, prompt=[97, 98], max_tokens=2)
    assert refused.value.body["param"] == "prompt"
    assert f"the workers of '{STANDIN}' do not take a prompt as token ids" in refused.value.body["message"]
    assert api(stack.web).completions.create(model=STANDIN, prompt="ab", max_tokens=2).choices[0].text == "ab"


def test_a_worker_lost_mid_stream_is_an_error_chunk_then_done(stack, standin):
    body = {
        "model": STANDIN,
        "messages": [{"role": "user", "content": "abc"}],
        "max_tokens": 5000,
        "stream": True,
    }
    with httpx.stream("POST", f"{stack.web.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk
        standin.kill()
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["error"]["code"] == "worker_lost"
    assert all("choices" in json.loads(line) for line in rest[:-2])


# ---- many clients at once ----------------------------------------------------------------------


def test_fifty_concurrent_streams_each_match_the_unstreamed_reply(stack):
    client = openai.AsyncOpenAI(base_url=f"{stack.web.url}/v1", api_key="x", max_retries=0, timeout=300)
    common = {"model": stack.model, "max_tokens": 8, "temperature": 1.0}

    messages = [{"role": "user", "content": "Write a function."}]  # one prompt: only the seed differs

    async def streamed(seed: int):
        stream = await client.chat.completions.create(
            **common, messages=messages, seed=seed, stream=True, stream_options={"include_usage": True}
        )
        return [chunk async for chunk in stream]

    async def unstreamed(seed: int):
        return await client.chat.completions.create(**common, messages=messages, seed=seed)

    async def run():
        streams = await asyncio.gather(*(streamed(seed) for seed in range(50)))
        replies = await asyncio.gather(*(unstreamed(seed) for seed in range(50)))
        await client.close()
        return streams, replies

    streams, replies = asyncio.run(run())
    assert len({chunks[0].id for chunks in streams}) == 50
    assert len({reply.choices[0].message.content for reply in replies}) > 1  # the seeds do matter
    for chunks, reply in zip(streams, replies, strict=True):
        assert {c.id for c in chunks} == {chunks[0].id}  # no chunk strayed into another stream
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content
        assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
        assert counts(chunks[-1].usage) == counts(reply.usage)


# ---- keys --------------------------------------------------------------------------------------


def test_with_a_key_configured_only_that_key_gets_in(stack, tmp_path):
    web = WebServer(stack.redis_url, tmp_path)  # a database of its own: keys close the whole API
    try:
        create = [sys.executable, "manage.py", "apikey", "create", "ci"]
        key = subprocess.run(create, cwd=ROOT, env=web.env, check=True, capture_output=True, text=True).stdout
        key = key.strip()
        missing = httpx.get(f"{web.url}/v1/models", timeout=10)  # no Authorization header at all
        assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            api(web, "kog-wrong").models.list()
        assert stack.model in [m.id for m in api(web, key).models.list().data]
        reply = api(web, key).completions.create(model=stack.model, prompt="a", max_tokens=1)
        assert reply.usage.completion_tokens == 1
    finally:
        web.stop()


def test_a_hosted_checkpoints_own_template_switches_and_sampling_are_honoured(
    start_web, start_worker, tmp_path
):
    """A fine-tune as Qwen3 ships: vLLM's chat_template_kwargs (enable_thinking) reach its template, and its
    generation_config.json's sampling is the default of a request that leaves it out (as vLLM's)."""
    from inference.synth import synth

    model = synth("tiny-qwen3", tmp_path / "thinker", seed=0)
    generation = json.loads((model / "generation_config.json").read_text())
    recommended = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    (model / "generation_config.json").write_text(
        json.dumps({**generation, "do_sample": True, **recommended, "max_new_tokens": 3})
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}no thinking here\n{% endif %}{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    web = start_web({"MODELS": str(model)})
    start_worker([str(model)])
    client = api(web)
    chat = {"model": "thinker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    plain = client.chat.completions.create(**chat)
    on = client.chat.completions.create(
        **chat, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    off = client.chat.completions.create(
        **chat, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert on.usage.prompt_tokens == plain.usage.prompt_tokens < off.usage.prompt_tokens

    database = sqlite3.connect(web.env["DATABASE_URL"].removeprefix("sqlite:///"))
    saved = "SELECT params FROM playground_generation WHERE job_id = ?"

    def params_of(reply) -> dict:
        (row,) = database.execute(saved, [reply.id.removeprefix("chatcmpl-")]).fetchall()
        return json.loads(row[0])

    assert {key: params_of(plain)[key] for key in recommended} == recommended
    # its max_new_tokens: the length of a request that gives none (the server's cap would be 512 and more)
    unbounded = client.chat.completions.create(model="thinker", messages=chat["messages"])
    assert params_of(unbounded)["max_new_tokens"] == 3 and unbounded.usage.completion_tokens <= 3
    chosen = client.chat.completions.create(**chat, temperature=0.2, extra_body={"top_k": 0})
    assert {key: params_of(chosen)[key] for key in recommended} == {
        **recommended,
        "temperature": 0.2,
        "top_k": 0,
    }
