"""Saving finished generations: one row per job, whoever (page or API) sees the job end first."""

from __future__ import annotations

from django.db import IntegrityError

from inference.protocol import JobSpec
from playground.models import Generation


def split_prompt(spec: JobSpec) -> tuple[str, str]:
    """(prompt, system prompt) as a person would read them: the last user turn and the system turns."""
    if not spec.messages:
        return spec.prompt or "", ""
    system = "\n\n".join(m.get("content", "") for m in spec.messages if m.get("role") == "system")
    users = [m.get("content", "") for m in spec.messages if m.get("role") == "user"]
    return (users[-1] if users else ""), system


def row_fields(spec: JobSpec, done: dict) -> dict:
    """The Generation columns for a job spec and the worker's `done` event (asdict(Done))."""
    stats = done.get("stats") or {}
    prompt, system_prompt = split_prompt(spec)
    bandwidth = stats.get("bandwidth_gbs") or None
    peak = stats.get("peak_bandwidth_gbs")
    return {
        "model": spec.model,
        "prompt": prompt,
        "system_prompt": system_prompt,
        "messages": spec.messages,
        "params": spec.params,
        "output": done.get("text", ""),
        "finish_reason": done.get("finish_reason", ""),
        "source": spec.source if spec.source in Generation.Source.values else Generation.Source.WEB,
        "prompt_tokens": stats.get("prompt_tokens", 0),
        "completion_tokens": stats.get("completion_tokens", 0),
        "prefill_ms": stats.get("prefill_ms"),
        "ttft_ms": stats.get("ttft_ms"),
        "decode_tok_s": stats.get("decode_tok_s"),
        "total_ms": stats.get("total_ms"),
        "bandwidth_gbs": bandwidth if peak else None,  # only meaningful against a device's peak
        "peak_pct": 100 * bandwidth / peak if bandwidth and peak else None,
    }


async def save_generation(spec: JobSpec, done: dict) -> Generation:
    """Store a finished job; idempotent: a second call for the same job returns the first row."""
    try:
        generation, _ = await Generation.objects.aget_or_create(
            job_id=spec.id, defaults=row_fields(spec, done)
        )
    except IntegrityError:  # two savers raced on the same job: the other one won
        generation = await Generation.objects.aget(job_id=spec.id)
    return generation
