"""Saving finished generations: one row per job, whoever (page or API) sees the job end first; and
deleting old ones (PLAYGROUND_RETENTION_DAYS, 30 days by default: a web process prunes at most hourly, after a
save or a request; `manage.py prune_generations` by hand)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, connections
from django.utils import timezone

from common.protocol import JobSpec
from playground.models import Generation

log = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 3600.0  # a web process prunes at most once an hour
PRUNE_BATCH = 500  # rows per DELETE: short transactions, so that saves in between never wait long


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
        # the chat template's further variables beside the sampling: what the share page shows of the run
        "params": {
            # a prediction changes nothing in the output: not kept
            **{name: value for name, value in spec.params.items() if name != "prediction"},
            **({"chat_template_kwargs": spec.template_kwargs} if spec.template_kwargs else {}),
            # a fill-in-the-middle job's code after the cursor (the prompt is the code before it)
            **({"suffix": spec.suffix} if spec.suffix is not None else {}),
        },
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
    prune_soon()
    return generation


def prune_generations(older_than_days: float, dry_run: bool = False) -> int:
    """Delete the generations saved more than `older_than_days` days ago (their share links then answer
    404); returns how many there were. A dry run only counts them."""
    old = Generation.objects.filter(created__lt=timezone.now() - timedelta(days=older_than_days))
    if dry_run:
        return old.count()
    deleted = 0
    while ids := list(old.values_list("pk", flat=True)[:PRUNE_BATCH]):
        deleted += Generation.objects.filter(pk__in=ids).delete()[0]
    return deleted


def database_bytes() -> int | None:
    """The database's size: SQLite's pages, PostgreSQL's own count; None for another engine. Sync: call it
    through sync_to_async."""
    connection = connections["default"]
    queries = {
        "sqlite": "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        "postgresql": "SELECT pg_database_size(current_database())",
    }
    if connection.vendor not in queries:
        return None
    try:
        with connection.cursor() as cursor:
            cursor.execute(queries[connection.vendor])
            return int(cursor.fetchone()[0])
    finally:
        connections.close_all()  # this thread's connections: a pool thread would keep them open


# When this process may prune next (time.monotonic()), and the prune under way
_next_prune = 0.0
_pruning: asyncio.Task | None = None


def prune_soon() -> asyncio.Task | None:
    """With PLAYGROUND_RETENTION_DAYS set, start pruning in the background when this process has not
    pruned for an hour (its first save included); the caller never waits for it. Returns the task."""
    global _next_prune, _pruning
    days = settings.PLAYGROUND_RETENTION_DAYS
    if days is None or time.monotonic() < _next_prune or (_pruning is not None and not _pruning.done()):
        return None
    _next_prune = time.monotonic() + PRUNE_INTERVAL_S
    # a context of its own: not the request's, whose thread for database calls ends with the request
    _pruning = asyncio.get_running_loop().create_task(_prune(days), context=contextvars.Context())
    return _pruning


def _prune_in_thread(days: int) -> int:
    try:
        return prune_generations(days)
    finally:
        connections.close_all()  # this thread's connections: a pool thread would keep them open


async def _prune(days: int) -> None:
    try:
        deleted = await sync_to_async(_prune_in_thread, thread_sensitive=False)(days)
    except Exception:  # the next save, an hour on, tries again
        log.exception("could not prune generations older than %s days", days)
        return
    if deleted:
        log.info("pruned %d generations older than %s days", deleted, days)
