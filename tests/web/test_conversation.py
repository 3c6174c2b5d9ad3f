"""Conversations on the page: a follow-up's earlier turns become the chat's messages, are refused clearly
when they cannot be, and are shown (and offered again) by the share page. The page itself: test_page_ux.py."""

from __future__ import annotations

import html
import json
import re

import pytest

from common.events import InvalidRequest
from playground.jobs import spec_from_frame
from playground.models import Generation

CHAT = {"coder": {"chat": True}}
COMPLETION = {"coder": {"chat": False}}
TURNS = [
    {"prompt": "def add(a, b):", "answer": "    return a + b"},
    {"prompt": "now subtract", "answer": "- b"},
]


def refusal(frame: dict, models: dict = CHAT) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        spec_from_frame({"prompt": "and multiply?", **frame}, models)
    return caught.value


def test_earlier_turns_come_before_the_prompt_after_the_system_prompt():
    spec = spec_from_frame({"prompt": "and multiply?", "system_prompt": "be brief", "history": TURNS}, CHAT)
    assert spec.chat and spec.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "now subtract"},
        {"role": "assistant", "content": "- b"},
        {"role": "user", "content": "and multiply?"},
    ]
    # no history (or an empty one) is a single turn, as before
    for frame in ({}, {"history": []}, {"history": None}):
        assert spec_from_frame({"prompt": "p", **frame}, CHAT).messages == [{"role": "user", "content": "p"}]


def test_a_completion_model_refuses_a_conversation_and_says_what_to_do():
    error = refusal({"history": TURNS}, COMPLETION)
    assert error.field == "history" and "new chat" in error.message and "chat model" in error.message
    assert spec_from_frame({"prompt": "p", "history": []}, COMPLETION).prompt == "p"


@pytest.mark.parametrize(
    "history, field, words",
    [
        ("not a list", "history", "must be a list"),
        ({"prompt": "a", "answer": "b"}, "history", "must be a list"),
        (["text"], "history[0]", "prompt and an answer"),
        ([{"prompt": "a"}], "history[0]", "prompt and an answer"),
        ([TURNS[0], {"prompt": "a", "answer": 3}], "history[1]", "both strings"),
        ([{"prompt": "  \n", "answer": "b"}], "history[0].prompt", "non-empty"),
        ([{"prompt": "a", "answer": "\ud83d"}], "history[0].answer", "unpaired surrogate"),
        ([{"prompt": "\udc00 b", "answer": ""}], "history[0].prompt", "unpaired surrogate"),
    ],
)
def test_a_malformed_history_is_refused_naming_the_turn(history, field, words):
    error = refusal({"history": history})
    assert error.field == field and words in error.message, (error.field, error.message)


def test_the_whole_conversation_counts_against_the_prompt_limit(settings):
    settings.PLAYGROUND_MAX_PROMPT_CHARS = 100
    prompt = "x" * 40
    fits = [{"prompt": "y" * 30, "answer": "z" * 30}]  # 100 characters with the prompt
    assert len(spec_from_frame({"prompt": prompt, "history": fits}, CHAT).messages) == 3
    error = refusal({"prompt": prompt, "history": [*fits, {"prompt": "w", "answer": ""}]})
    assert error.field == "history" and "101 characters" in error.message and "limit is 100" in error.message
    assert "new chat" in error.message


# ---- the share page -------------------------------------------------------------------------------


def shared(messages: list[dict], **fields) -> Generation:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return Generation.objects.create(
        job_id=f"job-{len(messages)}-{users[-1][:8]}", model="coder", prompt=users[-1], messages=messages,
        output="the answer", finish_reason="stop", **fields,
    )  # fmt: skip


def form_history(page: str) -> list[dict] | None:
    found = re.search(r'data-history="([^"]*)"', page)
    return json.loads(html.unescape(found.group(1))) if found else None


XSS = "<img src=x onerror=alert(1)>"
# a turn on the share page: who spoke, its box's classes, its text (in a code element to highlight, if the model's)
TURN = (
    r'<span class="turn-speaker">(\w+)</span><pre class="(prompt-box[^"]*?)(?: capped)?"[^>]*>\n?'
    r'(?:<code class="hljs" data-highlight-turn>)?(.*?)(?:</code>)?</pre>'
)


@pytest.fixture
def client(client, settings, redis_url):
    settings.REDIS_URL = redis_url  # the playground's page asks the job queue which workers are up
    return client


@pytest.mark.django_db
def test_the_share_page_shows_the_earlier_turns_in_order_as_text_and_try_it_carries_them(client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": f"first {XSS}"},
        {"role": "assistant", "content": 'answer "one" & more'},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer two"},
        {"role": "user", "content": "third"},
    ]
    row = shared(messages, system_prompt="be brief")
    page = client.get(f"/g/{row.id}").content.decode()
    turns = re.search(r'<ol class="turns" id="share-turns">(.*?)</ol>', page, re.S).group(1)
    # the model's answers are code, highlighted on load; a person's prompts stay plain text
    spoken = re.findall(TURN, turns, re.S)
    assert [(who, box, html.unescape(text)) for who, box, text in spoken] == [
        ("User", "prompt-box", f"first {XSS}"),
        ("Model", "prompt-box answer-box", 'answer "one" & more'),
        ("User", "prompt-box", "second"),
        ("Model", "prompt-box answer-box", "answer two"),
    ]
    assert (
        XSS not in page
        and "Follow-up prompt" in page
        and "be brief" in page
        and 'id="prompt-only"' not in page
    )

    prefilled = client.get(f"/?from={row.id}").content.decode()
    assert form_history(prefilled) == [
        {"prompt": f"first {XSS}", "answer": 'answer "one" & more'},
        {"prompt": "second", "answer": "answer two"},
    ]
    assert XSS not in prefilled and 'data-prefilled="true"' in prefilled


@pytest.mark.django_db
def test_a_single_turn_or_an_api_conversation_the_page_cannot_hold(client):
    single = shared([{"role": "user", "content": "only"}])
    page = client.get(f"/g/{single.id}").content.decode()
    assert 'id="share-turns"' not in page and "<h2>Prompt</h2>" in page and 'id="prompt-only"' not in page
    assert form_history(client.get(f"/?from={single.id}").content.decode()) is None

    # an API client's turns may not alternate: shown as they are; Try it yourself says it brings the prompt alone
    api = shared(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    )
    page = client.get(f"/g/{api.id}").content.decode()
    assert re.findall(r'<span class="turn-speaker">(\w+)</span>', page) == ["User", "User"]
    assert 'id="prompt-only"' in page and "brings back the prompt alone" in page
    assert form_history(client.get(f"/?from={api.id}").content.decode()) is None

    # ... or go on after the prompt: the start of an answer that the model continued
    begun = shared([
        {"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"},
        {"role": "user", "content": "and sub?"}, {"role": "assistant", "content": f"def sub(a, b): {XSS}"},
    ])  # fmt: skip
    page = client.get(f"/g/{begun.id}").content.decode()
    after = re.search(r'<ol class="turns" id="share-after">(.*?)</ol>', page, re.S).group(1)
    ((who, _, text),) = re.findall(TURN, after, re.S)
    assert (who, html.unescape(text)) == ("Model", f"def sub(a, b): {XSS}")
    assert XSS not in page and 'id="prompt-only"' in page
    assert form_history(client.get(f"/?from={begun.id}").content.decode()) is None
