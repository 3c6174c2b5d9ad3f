"""Saving finished generations: the mapping from a job and its done event, and idempotence."""

from __future__ import annotations

import re

import pytest

from common.protocol import JobSpec
from playground.models import Generation
from playground.store import save_generation

pytestmark = pytest.mark.django_db(transaction=True)


def done_event(text="out", peak=None) -> dict:
    stats = {
        "prompt_tokens": 5, "completion_tokens": 3, "prefill_ms": 1.5, "ttft_ms": 2.5, "decode_tok_s": 400.0,
        "total_ms": 9.0, "token_times": [0.1, 0.2, 0.3], "bytes_per_token": 4_000_000_000,
        "peak_bandwidth_gbs": peak, "bandwidth_gbs": 1600.0,
    }  # fmt: skip
    return {"finish_reason": "length", "text": text, "stats": stats, "kind": "done"}


async def test_saving_twice_keeps_one_row():
    spec = JobSpec(model="m", prompt="hello", params={"max_new_tokens": 3})
    first = await save_generation(spec, done_event())
    second = await save_generation(spec, done_event(text="something else"))
    assert first.id == second.id and second.output == "out"
    assert await Generation.objects.acount() == 1
    row = await Generation.objects.aget(job_id=spec.id)
    assert (row.prompt, row.output, row.params, row.source) == ("hello", "out", {"max_new_tokens": 3}, "web")
    assert (row.prompt_tokens, row.completion_tokens, row.decode_tok_s, row.ttft_ms) == (5, 3, 400.0, 2.5)
    assert row.bandwidth_gbs is None and row.peak_pct is None  # a CPU run has no peak to compare with
    assert len(row.id) == 12 and row.get_absolute_url() == f"/g/{row.id}"


async def test_a_prediction_is_not_kept_with_the_run():
    """A prediction changes nothing in the output (it may be as long as the prompt): the row keeps the rest."""
    spec = JobSpec(model="m", prompt="hello", params={"max_new_tokens": 3, "prediction": "hello world"})
    row = await save_generation(spec, done_event())
    assert row.params == {"max_new_tokens": 3}


async def test_gpu_bandwidth_and_chat_messages():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    spec = JobSpec(model="m", messages=messages, chat=True, source="api")
    row = await save_generation(spec, done_event(peak=3200.0))
    assert (row.prompt, row.system_prompt, row.messages, row.source) == (
        "second",
        "be brief",
        messages,
        "api",
    )
    assert row.bandwidth_gbs == 1600.0 and row.peak_pct == 50.0


def test_new_share_ids_are_letters_and_digits_so_no_link_ends_in_a_dash_or_underscore():
    """A markdown autolinker (or a chat app) ends a link before a trailing "_" or "-"."""
    import math

    from playground.models import ID_ALPHABET, short_id

    ids = [short_id() for _ in range(3000)]
    assert all(re.fullmatch(r"[A-Za-z0-9]{12}", i) for i in ids), [i for i in ids if not i.isalnum()][:5]
    assert len(set(ids)) == len(ids)
    assert len(set("".join(ids))) == 62  # every letter and digit turns up: the whole alphabet is drawn from
    assert len(ID_ALPHABET) == 62 and 12 * math.log2(len(ID_ALPHABET)) >= 71  # random bits per id
