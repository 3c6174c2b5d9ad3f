"""HTTP pages: the playground and a shared generation (the probes are in health.py)."""

from __future__ import annotations

import json
import re

import redis
from django.conf import settings
from django.http import HttpResponsePermanentRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.http import urlencode
from django.utils.text import Truncator

from common.events import SamplingParams
from playground.jobs import PARAM_FIELDS, job_client, worker_summary
from playground.models import Generation

# The playground's form as it first appears.
FORM_DEFAULTS = {
    "prompt": "",
    "system_prompt": "",
    "model": "",
    "temperature": 0.2,
    "top_p": 0.95,
    "max_tokens": 512,
}
# Generation.params (SamplingParams' field names) -> the page's field, from the mapping the page's frames use
PAGE_FIELDS = {param: page_field for page_field, param in PARAM_FIELDS.items()}
# ... and the label the share page shows, in its order
PARAM_LABELS = {
    "temperature": "Temperature",
    "top_p": "Top-p",
    "top_k": "Top-k",
    "max_new_tokens": "Max tokens",
    "repetition_penalty": "Repetition penalty",
    "seed": "Seed",
    "stop": "Stop",
    "chat_template_kwargs": "Chat template variables",
}
# Values that change nothing (no top-k cut, no penalty, no nucleus cut, no stop string): not shown
NEUTRAL = {"top_k": 0, "repetition_penalty": 1.0, "top_p": 1.0, "seed": None, "stop": []}
# Settings the playground has no field for: "Try it yourself" cannot bring them, and says so
NOT_ON_THE_PAGE = {"seed": "the seed", "top_k": "top-k", "repetition_penalty": "the repetition penalty",
                   "stop": "the stop strings", "chat_template_kwargs": "the chat template variables"}  # fmt: skip
# Unicode's text-direction controls: shown as their code points, never obeyed (as highlight.js does on the page)
BIDI_CONTROLS = re.compile(r"[\u202a-\u202e\u2066-\u2069]")
# What a link preview's title and description leave out: control characters and direction controls
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u061c\u202a-\u202e\u2066-\u2069]")
# A share page never changes; a takedown (a row deleted in /admin/) reaches caches within this long
SHARE_MAX_AGE_S = 300
# Who said an earlier turn of a shared conversation
SPEAKERS = {"user": "User", "assistant": "Model"}


async def index(request):
    try:
        summary, queue_ok = worker_summary(await job_client().workers()), True
    except redis.RedisError:
        summary, queue_ok = worker_summary([]), False
    context = {
        "summary": summary,
        "queue_ok": queue_ok,
        "max_new_tokens": settings.PLAYGROUND_MAX_NEW_TOKENS,
        "max_prompt_chars": settings.PLAYGROUND_MAX_PROMPT_CHARS,
        "retention_days": settings.PLAYGROUND_RETENTION_DAYS,
        "form": await form_values(request.GET.get("from")),
    }
    return render(request, "playground/index.html", context)


async def form_values(generation_id: str | None) -> dict:
    """The form's first values: the defaults, or a shared generation's prompt and settings ("Try it
    yourself" links to /?from=<id>). The template escapes them; the page never evaluates them."""
    form = {name: str(value) for name, value in FORM_DEFAULTS.items()}
    row = await Generation.objects.filter(pk=generation_id).afirst() if generation_id else None
    if row is None:
        return form
    form.update(prompt=row.prompt, system_prompt=row.system_prompt, model=row.model, prefilled="true")
    suffix = (row.params or {}).get("suffix")
    if isinstance(suffix, str):  # a code completion: the code after the cursor, and the mode switched on
        form.update(suffix=suffix, fim="true")
    history = follow_up_history(*conversation_parts(row))
    form["history"] = json.dumps(history) if history else ""  # the form's data-history, read by store.js
    for param, field in PAGE_FIELDS.items():
        if row.params.get(param) is not None and field in form:
            form[field] = str(row.params[param])
    return form


def conversation_parts(generation: Generation) -> tuple[list[dict], list[dict]]:
    """A chat's turns before the prompt the shared answer replies to (its last user turn), and those after it
    (an API client's start of the answer, which the model continued); the system turns are the system
    prompt, shown on their own."""
    messages = [m for m in generation.messages or [] if m.get("role") != "system"]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return [], []
    return messages[: users[-1]], messages[users[-1] + 1 :]


def spoken(messages: list[dict]) -> list[dict]:
    """Each turn as the share page shows it: who spoke, the text, and whether it is the model's (highlighted)."""
    return [
        {"speaker": SPEAKERS.get(m.get("role"), m.get("role")), "text": m.get("content", ""),
         "model": m.get("role") == "assistant"}
        for m in messages
    ]  # fmt: skip


def follow_up_history(earlier: list[dict], after: list[dict]) -> list[dict] | None:
    """The earlier turns as the page's conversation ([{prompt, answer}], oldest first) for "Try it yourself";
    None when the page cannot hold them: an API client's turns that do not alternate as the page's own do, or
    that go on after the prompt (`earlier` and `after`: conversation_parts)."""
    roles = [m.get("role") for m in earlier]
    if after or roles != ["user", "assistant"] * (len(earlier) // 2):
        return None
    return [
        {"prompt": q["content"], "answer": a["content"]}
        for q, a in zip(earlier[::2], earlier[1::2], strict=True)
    ]


def stat_rows(generation: Generation) -> list[tuple[str, str]]:
    def ms(value):
        return f"{value:,.1f} ms" if value is not None else "–"

    rows = [
        ("Prompt tokens", f"{generation.prompt_tokens:,}"),
        ("Completion tokens", f"{generation.completion_tokens:,}"),
        ("Prefill", ms(generation.prefill_ms)),
        ("Time to first token", ms(generation.ttft_ms)),
        # a one-token run has no decode rate: the rate counts the gaps after the first token
        ("Decode", f"{generation.decode_tok_s:,.1f} tok/s" if generation.decode_tok_s else "–"),
        ("Total", ms(generation.total_ms)),
    ]
    if generation.bandwidth_gbs is not None:
        rows.append(
            ("Bandwidth", f"{generation.bandwidth_gbs:,.0f} GB/s ({generation.peak_pct:.0f}% of peak)")
        )
    return rows


def quoted(value) -> str:
    """A string (or any JSON value) as a JSON literal spells it, so that newlines and spaces show; a direction
    control as its code point (written \\u202e, it is not obeyed)."""
    return BIDI_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def set_params(generation: Generation) -> dict:
    """The settings the run asked for that change anything: none unset, none at a value that changes nothing."""
    params = generation.params or {}
    return {
        key: params[key]
        for key in PARAM_LABELS
        if key in params and params[key] not in (None, NEUTRAL.get(key))
    }


def param_rows(generation: Generation) -> list[tuple[str, str]]:
    """The sampling settings the run asked for, in the page's words (unset ones took the defaults)."""
    rows = []
    for key, value in set_params(generation).items():
        if key == "stop":
            value = (
                " ".join(quoted(text) for text in value) if isinstance(value, list) else quoted(str(value))
            )
        elif key == "chat_template_kwargs":  # as the client sent them
            value = quoted(value)
        rows.append((PARAM_LABELS[key], str(value)))
    return rows


def left_out(generation: Generation) -> list[str]:
    """The run's settings that "Try it yourself" cannot bring (the playground has no field for them)."""
    asked = set_params(generation)
    return [words for key, words in NOT_ON_THE_PAGE.items() if key in asked]


def in_words(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def one_line(text: str, chars: int) -> str:
    """Text for a title or a link preview: no control characters, whitespace as single spaces, cut to `chars`."""
    return Truncator(" ".join(UNPRINTABLE.sub(" ", text).split())).chars(chars)


def preview(generation: Generation) -> dict:
    """The share page's <title> and link-preview texts (the template escapes them)."""
    first_line = next((line for line in generation.prompt.splitlines() if line.strip()), "")
    title = f"{one_line(first_line, 60) or 'Shared generation'} · {one_line(generation.model, 40)}"
    answer = one_line(generation.output, 200) or "(no output)"
    return {"title": title, "description": f"{one_line(generation.model, 40)}: {answer}"}


def finish_label(generation: Generation) -> str:
    """Why the run ended, in the playground's words (the worker says "length" for either limit)."""
    if generation.finish_reason == "stop":
        return "end of answer"
    if generation.finish_reason == "cancelled":
        return "stopped · partial output kept" if generation.output else "stopped before any output"
    if generation.finish_reason == "length":
        asked = (generation.params or {}).get("max_new_tokens") or SamplingParams.max_new_tokens
        return "reached max tokens" if generation.completion_tokens >= asked else "context full"
    return generation.finish_reason


def generation(request, generation_id: str):
    row = get_object_or_404(Generation, pk=generation_id)
    earlier, after = conversation_parts(row)
    missing = left_out(row)
    context = {
        "generation": row,
        "stats": stat_rows(row),
        "earlier": spoken(earlier),
        "after": spoken(after),
        # "Try it yourself" brings back the prompt alone when the page cannot hold the conversation
        "prompt_only": bool(earlier or after) and follow_up_history(earlier, after) is None,
        "params": param_rows(row),
        # a code completion's code after the cursor: shown after the middle the model wrote (None: not one)
        "suffix": (row.params or {}).get("suffix"),
        "left_out": in_words(missing) if missing else "",
        "left_out_count": len(missing),
        "finish": finish_label(row),
        "try_url": reverse("index") + "?" + urlencode({"from": row.pk}),
        "page_url": request.build_absolute_uri(row.get_absolute_url()),  # og:url, without a query string
        "preview": preview(row),
    }
    response = render(request, "playground/generation.html", context)
    # the page never changes (a run is saved once): caches may keep it a while, search engines may not index it
    response["Cache-Control"] = f"public, max-age={SHARE_MAX_AGE_S}"
    response["X-Robots-Tag"] = "noindex"
    return response


def generation_with_slash(request, generation_id: str):
    """/g/<id>/ (a link pasted with a slash added) -> /g/<id>, for good."""
    return HttpResponsePermanentRedirect(reverse("generation", args=[generation_id]))
