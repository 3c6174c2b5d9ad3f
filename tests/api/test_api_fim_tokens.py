"""What agents ask of the API besides a completion, end to end (the official openai client, daphne, Redis, a real
worker): fill in the middle through `suffix` and llama.cpp's /infill, logprobs in OpenAI's shapes checked against
a forward pass of the same model, a prompt given as token ids, /tokenize and /detokenize, a model's facts,
/health.

The worker serves a tiny synthetic checkpoint whose tokenizer carries Qwen2.5-Coder's FIM tokens
(tests/support/fim_checkpoint.py) as `coder`, and the tiny-qwen2 preset (no FIM tokens) as `plain`."""

from __future__ import annotations

import json
import sqlite3

import httpx
import openai
import pytest
import redis
import torch

from common.events import SamplingParams
from tests.support.fim_checkpoint import fim_stack, greedy_middle

PREFIX = "def area(radius):\n    return "
SUFFIX = "\n\n\nprint(area(2.0))\n"
INFILL = {"model": "coder", "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 24, "temperature": 0}
# what ended a middle (Done.ended_by) -> llama.cpp's stop_type for it
INFILL_STOP_TYPES = {"eos": "eos", "length": "limit", "indent": "limit", "stop_string": "word"}


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    redis.Redis.from_url(redis_server).flushall()
    with fim_stack(redis_server, tmp_path_factory.mktemp("fim")) as served:
        yield served


@pytest.fixture(scope="module")
def engine(stack):
    """The worker's `coder` loaded here too: the reference for its ids, its middles and its logprobs."""
    from inference.engine import Engine

    return Engine.load(str(stack.checkpoint), device="cpu")


def api(web) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web.url}/v1", api_key="no-key-needed", max_retries=0, timeout=60)


def post(web, path: str, body: dict) -> httpx.Response:
    return httpx.post(web.url + path, json=body, timeout=60)


# ---- facts, probes, tokens -----------------------------------------------------------------------------


def test_health_and_model_facts(stack, engine):
    health = httpx.get(stack.web.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["models"] == {"coder": 1, "plain": 1}

    coder = api(stack.web).models.retrieve("coder").model_extra
    assert coder["max_model_len"] == engine.max_context
    assert coder["chat_template"] is True and coder["logprobs"] is True
    assert coder["fim"] is True
    assert coder["fim_tokens"] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    assert coder["generation_defaults"] == engine.sampling_defaults
    assert api(stack.web).models.retrieve("plain").model_extra["fim"] is False
    with pytest.raises(openai.NotFoundError):
        api(stack.web).models.retrieve("nope")


def test_tokenize_gives_the_model_tokenizers_ids(stack, engine):
    text = "def f(x):\n    return x * 2  # <|fim_prefix|> is text here, naïve ✓"
    for path in ("/tokenize", "/v1/tokenize"):
        reply = post(stack.web, path, {"model": "coder", "prompt": text})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["tokens"] == engine.tokenizer.encode_text(text)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.max_context
    fim_prefix_id = engine.tokenizer._tok.token_to_id("<|fim_prefix|>")
    assert fim_prefix_id not in body["tokens"]  # a typed special token's spelling stays text

    messages = [{"role": "user", "content": "hello"}]
    chat = post(stack.web, "/tokenize", {"model": "coder", "messages": messages}).json()
    assert chat["tokens"] == engine.tokenizer.encode_chat(messages)

    back = post(stack.web, "/detokenize", {"model": "coder", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_is_a_request_against_the_callers_budget_and_leaves_nothing_in_redis(
    stack, redis_server, tmp_path
):
    from common.protocol import events_key, job_key
    from tests.support import WebServer

    # its own web process at 3 requests a minute, whose one caller is a fresh address (through a trusted proxy)
    env = {
        "MODELS": "coder",
        "PLAYGROUND_IP_REQUESTS_PER_MIN": "3",
        "PLAYGROUND_TRUSTED_PROXIES": "127.0.0.1",
    }
    limited = WebServer(redis_server, tmp_path, env)
    try:
        caller = {"X-Forwarded-For": "203.0.113.9"}
        body = {"model": "coder", "prompt": "def f(x):\n    return x\n" * 50}
        answered = [
            httpx.post(limited.url + "/tokenize", json=body, headers=caller, timeout=60) for _ in range(3)
        ]
        assert [reply.status_code for reply in answered] == [200, 200, 200]
        refused = httpx.post(limited.url + "/tokenize", json=body, headers=caller, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["Retry-After"]) > 0
        detokenized = httpx.post(
            limited.url + "/detokenize", json={"model": "coder", "tokens": [1]}, headers=caller
        )
        assert detokenized.status_code == 429  # the same budget
    finally:
        limited.stop()
    store = redis.Redis.from_url(redis_server)
    for reply in answered:  # each answer read, its job's record and events (the prompt) are gone at once
        job_id = reply.headers["x-request-id"]
        assert store.exists(job_key(job_id), events_key(job_id)) == 0, job_id


def test_tokenize_refusals_say_what_is_wrong(stack):
    cases = [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "does not exist"),
        ("/tokenize", {"model": "coder"}, 400, "prompt: must be a string"),
        ("/tokenize", {"model": "coder", "prompt": "x", "add_special_tokens": "yes"}, 400, "boolean"),
        ("/detokenize", {"model": "coder", "tokens": [1, "2"]}, 400, "list of token ids"),
        ("/detokenize", {"model": "coder", "tokens": [10**9]}, 400, "token ids must be integers in [0,"),
        # a chat is counted as /v1/chat/completions counts it, against the same cap
        ("/tokenize", {"model": "coder", "messages": [{"role": "user", "content": "ab " * 40_000}]}, 400,
         "messages: is 120000 characters long"),
    ]  # fmt: skip
    for path, body, status, words in cases:
        reply = post(stack.web, path, body)
        assert reply.status_code == status, (body, reply.text)
        assert words in reply.json()["error"]["message"], (body, reply.text)
    assert httpx.get(stack.web.url + "/health", timeout=10).status_code == 200  # nothing went down


# ---- fill in the middle --------------------------------------------------------------------------------


def test_fim_with_suffix_returns_the_middle_streamed_and_not(stack, engine):
    client = api(stack.web)
    kwargs = {"model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 12, "temperature": 0}
    reply = client.completions.create(**kwargs)
    ids, local = greedy_middle(engine, PREFIX, SUFFIX, 12)
    assert reply.choices[0].text == local.text and local.text
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == local.stats.completion_tokens
    timings = reply.model_extra["timings"]
    assert timings["prompt_n"] == len(ids) and timings["predicted_n"] == reply.usage.completion_tokens

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == local.text
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and "timings" in finished[0].model_extra
    # the same prompt again: its prefix is now cached (usage.prompt_tokens_details), the counts are the same
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
    )


def test_infill_in_llama_cpp_shape(stack, engine):
    body = {
        "model": "coder",
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "n_predict": 12,
        "temperature": 0,
    }
    _, local = greedy_middle(engine, PREFIX, SUFFIX, 12)
    reply = post(stack.web, "/infill", body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["content"] == local.text and answer["stop"] is True
    assert answer["tokens_predicted"] == local.stats.completion_tokens
    assert answer["timings"]["predicted_n"] == local.stats.completion_tokens
    # a prediction of the middle (OpenAI's, taken here too): drafts from it, the same middle
    predicted = post(stack.web, "/infill", {**body, "prediction": {"type": "content", "content": local.text}})
    assert predicted.status_code == 200, predicted.text
    assert predicted.json()["content"] == local.text

    with httpx.stream("POST", stack.web.url + "/infill", json={**body, "stream": True}, timeout=60) as stream:
        lines = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert "".join(line["content"] for line in lines) == local.text
    assert [line["stop"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "timings" in lines[-1]

    # the cursor at the very start and at the very end of a file are FIM requests too
    for prefix, suffix in (("", SUFFIX), (PREFIX, "")):
        edge = post(stack.web, "/infill", {**body, "input_prefix": prefix, "input_suffix": suffix})
        assert edge.status_code == 200, edge.text
        assert edge.json()["content"] == greedy_middle(engine, prefix, suffix, 12)[1].text


def test_infill_n_indent_ends_the_middle_with_its_block(stack, engine):
    # llama.cpp's n_indent: the worker stops before a line indented less, as the local engine does, and says
    # so as llama.cpp does (stop_type limit)
    for n_indent in (0, 4, 40):
        local = greedy_middle(engine, PREFIX, SUFFIX, 24, n_indent=n_indent)[1]
        reply = post(stack.web, "/infill", {**INFILL, "n_indent": n_indent})
        assert reply.status_code == 200, reply.text
        assert reply.json()["content"] == local.text
        assert reply.json()["stop_type"] == INFILL_STOP_TYPES[local.ended_by]
    for bad in (-1, 257, "4", True):
        reply = post(stack.web, "/infill", {**INFILL, "n_indent": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "n_indent", reply.text
    assert post(stack.web, "/infill", INFILL).status_code == 200  # the worker took the refusals in its stride


def test_infill_says_what_ended_the_middle_as_llama_cpp_does(stack, engine):
    body = INFILL
    free = greedy_middle(engine, PREFIX, SUFFIX, 24)[1]
    word = free.text[len(free.text) // 2 :][:3]
    assert len(word) == 3, free.text
    by_word = post(stack.web, "/infill", {**body, "stop": [word]}).json()
    assert by_word["content"] == free.text[: free.text.find(word)]
    assert (by_word["stop_type"], by_word["stopping_word"]) == ("word", word)
    assert post(stack.web, "/infill", body).json()["stop_type"] == INFILL_STOP_TYPES[free.ended_by]
    # n_predict -1 is llama.cpp's "no limit of mine": the server's own cap
    unlimited = post(stack.web, "/infill", {**body, "n_predict": -1})
    assert unlimited.status_code == 200, unlimited.text
    assert unlimited.json()["content"].startswith(free.text)
    # a refusal names the field as /infill's client sent it
    for bad in (0, -2, "5", 1.5):
        reply = post(stack.web, "/infill", {**body, "n_predict": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "n_predict", reply.text
        assert reply.json()["error"]["message"].startswith("n_predict:"), reply.text


def test_completions_give_vllms_stop_reason_streamed_and_not(stack):
    client = api(stack.web)
    kwargs = {
        "model": "coder",
        "prompt": "import os\n\ndef list_files(path):\n",
        "max_tokens": 24,
        "temperature": 0,
    }
    free = client.completions.create(**kwargs).choices[0]
    assert free.model_extra["stop_reason"] is None
    stop = free.text[len(free.text) // 2 :][:3]
    choice = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    last = [c for c in client.completions.create(**kwargs, stop=[stop], stream=True) if c.choices][-1]
    assert (last.choices[0].finish_reason, last.choices[0].model_extra["stop_reason"]) == ("stop", stop)


def test_a_reply_that_ends_at_once_still_has_its_logprobs_object(stack, engine):
    # a one-token prompt after which the model's first choice is its end token, found with the local copy
    vocab = engine.tokenizer.max_id + 1
    with torch.inference_mode():
        first = engine.model(torch.arange(vocab)[:, None])[:, -1, :vocab].argmax(-1)
    ends = engine.tokenizer.stop_ids
    prompt = next(
        [i] for i in range(vocab) if int(first[i]) in ends and i not in engine.tokenizer.special_ids
    )
    reply = api(stack.web).completions.create(
        model="coder", prompt=prompt, max_tokens=8, temperature=0, logprobs=1
    )
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason, reply.usage.completion_tokens) == ("", "stop", 1)
    assert choice.logprobs is not None
    assert (choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.text_offset) == (
        [],
        [],
        [],
    )


def test_text_offsets_index_the_text_through_split_characters_streamed_and_not(stack):
    prompt = "import os\n\ndef list_files(path):\n"  # the tiny model answers with stray bytes too
    kwargs = {"model": "coder", "prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 0}
    client = api(stack.web)
    choice = client.completions.create(**kwargs).choices[0]
    text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    # every token that is whole characters is found at its offset, also after tokens that were not
    whole = [i for i, token in enumerate(tokens) if "\ufffd" not in token]
    assert all(text[offsets[i] :].startswith(tokens[i]) for i in whole), list(
        zip(tokens, offsets, strict=True)
    )
    assert any("\ufffd" in token for token in tokens[: whole[-1]]), "no split or stray bytes: nothing checked"
    streamed = [o for c in client.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]  # fmt: skip
    assert streamed == offsets


def test_fim_refusals_name_the_model_and_the_field(stack):
    client = api(stack.web)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="plain", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
    error = refused.value.body
    assert error["param"] == "suffix" and error["code"] == "fim_not_supported"
    assert "'plain' has no fill-in-the-middle tokens" in error["message"]

    reply = post(stack.web, "/infill", {"model": "plain", "input_prefix": "a", "input_suffix": "b"})
    assert (
        reply.status_code == 400 and "'plain' has no fill-in-the-middle" in reply.json()["error"]["message"]
    )
    reply = post(
        stack.web, "/infill", {"model": "coder", "input_prefix": "a", "input_extra": [{"text": "x"}]}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_extra"

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="coder", messages=[{"role": "user", "content": "hi"}], extra_body={"suffix": "x"}
        )
    assert refused.value.body["param"] == "suffix"
    # a plain completion still works once the refusals are done
    assert client.completions.create(model="plain", prompt="def", max_tokens=2).choices[0].text is not None


# ---- logprobs ------------------------------------------------------------------------------------------


def reference_logprobs(engine, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """One forward pass over the prompt and the generated tokens (not the decode loop's steps): [n_new, V]
    log-probabilities of each new token's position, V the ids the tokenizer has, as the runner reads them."""
    ids = torch.tensor([prompt_ids + new_ids])
    with torch.inference_mode():
        logits = engine.model(ids)[0, len(prompt_ids) - 1 : -1, : engine.tokenizer.max_id + 1]
    return logits.float().log_softmax(-1)


def test_completion_logprobs_match_a_reference_forward_pass(stack, engine):
    prompt = "import os\n\ndef list_files(path):\n"
    reply = api(stack.web).completions.create(
        model="coder", prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    prompt_ids = engine.tokenizer.encode_text(prompt)
    local = list(engine.generate(prompt_ids, SamplingParams(max_new_tokens=8, temperature=0, logprobs=3)))
    new_ids = [i for event in local if event.kind == "delta" for i in event.token_ids]
    n = len(logprobs.tokens)
    assert n == reply.usage.completion_tokens and n > 0
    reference = reference_logprobs(engine, prompt_ids, new_ids[:n])
    names = engine.token_names
    for i, token_id in enumerate(new_ids[:n]):
        assert logprobs.tokens[i] == names.name(token_id)[0]
        assert logprobs.token_logprobs[i] == pytest.approx(float(reference[i, token_id]), abs=1e-3)
        top = logprobs.top_logprobs[i]
        assert next(iter(top)) == logprobs.tokens[i]  # greedy: the most likely token is the one chosen
        expected = reference[i].topk(3)
        for token_id_k, value in zip(expected.indices.tolist(), expected.values.tolist(), strict=True):
            assert top[names.name(token_id_k)[0]] == pytest.approx(value, abs=1e-3)
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == reply.choices[0].text


def test_an_echoed_completion_scores_its_prompt_as_a_forward_pass_does(stack, engine):
    prompt = "import os\n\ndef list_files(path):\n"
    kwargs = {
        "model": "coder",
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    reply = api(stack.web).completions.create(**kwargs)
    text, logprobs = reply.choices[0].text, reply.choices[0].logprobs
    prompt_ids = engine.tokenizer.encode_text(prompt)
    local = list(engine.generate(prompt_ids, SamplingParams(max_new_tokens=6, temperature=0)))
    new_ids = [i for event in local if event.kind == "delta" for i in event.token_ids]
    plain = "".join(event.text for event in local if event.kind == "delta")
    assert text == prompt + plain
    ids = prompt_ids + new_ids[: len(logprobs.tokens) - len(prompt_ids)]
    names = engine.token_names
    assert logprobs.tokens == [names.name(i)[0] for i in ids] and "".join(logprobs.tokens) == text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
    # the first token has nothing before it; every other is scored given the ones before it
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids]))[0, :-1, : engine.tokenizer.max_id + 1]
    reference = logits.float().log_softmax(-1)  # row r: what follows ids[r]
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(float(reference[i - 1, ids[i]]), abs=1e-3)
        # the 2 most likely and the chosen one, by text: where two ids spell the same text the likelier stays
        expected = reference[i - 1].topk(2)
        chosen = (ids[i], float(reference[i - 1, ids[i]]))
        candidates = [*zip(expected.indices.tolist(), expected.values.tolist(), strict=True), chosen]
        shown = {}
        for token_id, value in sorted(candidates, key=lambda pair: -pair[1]):
            shown.setdefault(names.name(token_id)[0], value)
        assert logprobs.top_logprobs[i] == pytest.approx(shown, abs=1e-3)

    chunks = list(api(stack.web).completions.create(**kwargs, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == prompt and "".join(texts) == text  # the prompt first, in a chunk of its own
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(logprobs.token_logprobs)


def test_an_echo_without_logprobs_is_the_prompt_then_the_reply(stack):
    client = api(stack.web)
    kwargs = {"model": "plain", "prompt": "def add(a, b):", "max_tokens": 5, "temperature": 0}
    reply = client.completions.create(**kwargs)
    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == "def add(a, b):" + reply.choices[0].text
    assert echoed.choices[0].logprobs is None
    assert echoed.usage.prompt_tokens == reply.usage.prompt_tokens  # the echo is not counted twice
    assert echoed.usage.completion_tokens == reply.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, echo=True, stream=True))
    assert streamed == echoed.choices[0].text


def test_echo_refusals(stack):
    client = api(stack.web)
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        lambda: client.chat.completions.create(model="coder", messages=messages, extra_body={"echo": True}),
        lambda: client.completions.create(model="coder", prompt="def f(", suffix=")\n", echo=True),
        lambda: client.completions.create(model="coder", prompt="a", extra_body={"echo": "yes"}),
    ]
    for call in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.body["param"] == "echo"


def test_chat_logprobs_streamed_and_not(stack, engine):
    client = api(stack.web)
    kwargs = {
        "model": "coder",
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
        (e.token, round(e.logprob, 5)) for e in content
    ]


def test_logprobs_refusals(stack):
    client = api(stack.web)
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (lambda: client.completions.create(model="coder", prompt="a", logprobs=21), "logprobs"),
        (lambda: client.chat.completions.create(model="coder", messages=messages, top_logprobs=2), "top_logprobs"),
        (lambda: client.chat.completions.create(model="coder", messages=messages, logprobs=True, top_logprobs=30),
         "top_logprobs"),
        (lambda: client.completions.create(model="coder", prompt="a", extra_body={"top_logprobs": 2}), "top_logprobs"),
    ]  # fmt: skip
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.body["param"] == param


# ---- a prompt as token ids -----------------------------------------------------------------------------


def saved_prompt(web, reply) -> str:
    database = sqlite3.connect(web.env["DATABASE_URL"].removeprefix("sqlite:///"))
    saved = "SELECT prompt FROM playground_generation WHERE job_id = ?"
    (row,) = database.execute(saved, [reply.id.removeprefix("cmpl-")]).fetchall()
    database.close()
    return row[0]


def test_a_prompt_of_token_ids_completes_as_its_text_does(stack, engine):
    client = api(stack.web)
    prompt = "import os\n\ndef list_files(path):\n"
    ids = engine.tokenizer.encode_text(prompt)
    kwargs = {"model": "coder", "max_tokens": 8, "temperature": 0, "logprobs": 0}
    from_text = client.completions.create(prompt=prompt, **kwargs)
    assert from_text.choices[0].text and from_text.usage.prompt_tokens == len(ids)
    for form in (ids, [ids]):  # OpenAI's two forms: a list of ids, and a list holding one
        from_ids = client.completions.create(prompt=form, **kwargs)
        assert from_ids.choices[0].text == from_text.choices[0].text
        assert from_ids.choices[0].logprobs.tokens == from_text.choices[0].logprobs.tokens
        assert (from_ids.usage.prompt_tokens, from_ids.usage.completion_tokens) == (
            len(ids),
            from_text.usage.completion_tokens,
        )
        assert saved_prompt(stack.web, from_ids) == prompt  # the run is kept with the ids' text
    streamed = client.completions.create(prompt=ids, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == from_text.choices[0].text


def test_an_echo_of_token_ids_is_their_text_and_their_scores(stack, engine):
    client = api(stack.web)
    prompt = "import os\n\ndef list_files(path):\n"
    ids = engine.tokenizer.encode_text(prompt)
    kwargs = {"model": "coder", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    from_text = client.completions.create(prompt=prompt, **kwargs).choices[0]
    from_ids = client.completions.create(prompt=ids, **kwargs).choices[0]
    assert from_ids.text.startswith(prompt) and from_ids.text == from_text.text
    assert from_ids.logprobs.tokens[: len(ids)] == [engine.token_names.name(i)[0] for i in ids]
    assert from_ids.logprobs.tokens == from_text.logprobs.tokens
    assert from_ids.logprobs.text_offset == from_text.logprobs.text_offset
    assert from_ids.logprobs.token_logprobs == pytest.approx(from_text.logprobs.token_logprobs)
    chunks = [c.choices[0] for c in client.completions.create(prompt=[ids], stream=True, **kwargs)]
    assert chunks[0].text == prompt and "".join(c.text for c in chunks) == from_text.text

    # ids no text encodes to are taken as given: a special token first, listed, and no character of the text
    im_start = engine.tokenizer._tok.token_to_id("<|im_start|>")
    given = [im_start, *ids]
    reply = client.completions.create(prompt=given, **{**kwargs, "max_tokens": 1})
    logprobs = reply.choices[0].logprobs
    assert reply.usage.prompt_tokens == len(given)
    assert reply.choices[0].text.startswith(prompt) and "<|im_start|>" not in reply.choices[0].text
    assert logprobs.tokens[:2] == ["<|im_start|>", engine.token_names.name(ids[0])[0]]
    assert logprobs.text_offset[:2] == [0, 0] and logprobs.token_logprobs[0] is None


def test_token_id_prompts_that_make_no_sense_are_refused_saying_why(stack, engine):
    client = api(stack.web)
    cases = [
        ({"prompt": []}, "prompt: must not be empty"),
        ({"prompt": [[5, 6], [7]]}, "batching several prompts is not supported, send one prompt per request"),
        ({"prompt": [5, "a"]}, "got 'a' in a list of token ids"),
        ({"prompt": [5, -1]}, "got -1 in a list of token ids"),
        ({"prompt": [5, 6], "suffix": "x"}, "token ids cannot go with a suffix"),
        ({"prompt": [5] * engine.max_context}, f"do not fit the {engine.max_context}-token context"),
    ]
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="coder", max_tokens=2, **kwargs)
        assert refused.value.body["param"] == "prompt" and words in refused.value.body["message"], kwargs
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="coder", messages=[{"role": "user", "content": "hi"}], extra_body={"prompt": [5, 6]}
        )
    assert refused.value.body["param"] == "prompt"
    assert "is not a field of /v1/chat/completions, which takes messages" in refused.value.body["message"]


def test_an_id_past_the_vocabulary_is_a_400_and_the_worker_serves_on(stack, engine):
    client = api(stack.web)
    limit = engine.tokenizer.max_id + 1
    for bad, stream in ((limit, False), (2**40, True)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="coder", prompt=[5, bad], max_tokens=2, stream=stream)
        error = refused.value.body
        assert error["param"] == "prompt" and error["code"] == "invalid_request"
        expected = f"prompt: token ids must be integers in [0, {limit}) (the model's vocabulary), got {bad}"
        assert expected in error["message"]
    reply = client.completions.create(model="coder", prompt=[5, limit - 1], max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == 2 and reply.usage.completion_tokens >= 1
    assert httpx.get(stack.web.url + "/health", timeout=10).json()["models"] == {"coder": 1, "plain": 1}
