"""HTTP pages: the playground and a shared generation (the probes are in health.py)."""

from __future__ import annotations

import redis
from django.conf import settings
from django.shortcuts import get_object_or_404, render

from playground.jobs import job_client, worker_summary
from playground.models import Generation


async def index(request):
    try:
        summary, queue_ok = worker_summary(await job_client().workers()), True
    except redis.RedisError:
        summary, queue_ok = worker_summary([]), False
    context = {"summary": summary, "queue_ok": queue_ok, "max_new_tokens": settings.PLAYGROUND_MAX_NEW_TOKENS}
    return render(request, "playground/index.html", context)


def stat_rows(generation: Generation) -> list[tuple[str, str]]:
    def ms(value):
        return f"{value:,.1f} ms" if value is not None else "–"

    rows = [
        ("Prompt tokens", f"{generation.prompt_tokens:,}"),
        ("Completion tokens", f"{generation.completion_tokens:,}"),
        ("Prefill", ms(generation.prefill_ms)),
        ("Time to first token", ms(generation.ttft_ms)),
        ("Decode", f"{generation.decode_tok_s:,.1f} tok/s" if generation.decode_tok_s is not None else "–"),
        ("Total", ms(generation.total_ms)),
    ]
    if generation.bandwidth_gbs is not None:
        rows.append(
            ("Bandwidth", f"{generation.bandwidth_gbs:,.0f} GB/s ({generation.peak_pct:.0f}% of peak)")
        )
    return rows


def generation(request, generation_id: str):
    row = get_object_or_404(Generation, pk=generation_id)
    return render(request, "playground/generation.html", {"generation": row, "stats": stat_rows(row)})
