"""Saved generations do not live forever: `manage.py prune_generations`, PLAYGROUND_RETENTION_DAYS (the web
process prunes by itself, in the background, at most hourly), what a pruned run's link answers, and the
admin's takedown (read-only rows, deletable)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.utils import timezone

from common.protocol import JobSpec
from playground import store
from playground.models import Generation
from playground.settings import retention_days
from playground.store import save_generation

DONE = {"finish_reason": "stop", "text": "out", "stats": {"completion_tokens": 3}}


def aged(days: float, **fields) -> Generation:
    """A generation saved `days` days ago."""
    defaults = {"job_id": f"job-{time.monotonic_ns()}", "model": "m", "prompt": "p", "output": "o",
                "finish_reason": "stop"}  # fmt: skip
    row = Generation.objects.create(**{**defaults, **fields})
    Generation.objects.filter(pk=row.pk).update(created=timezone.now() - timedelta(days=days))
    return row


@pytest.fixture
def fresh_process(monkeypatch):
    """This process has not pruned yet, as a web process that has just started."""
    monkeypatch.setattr(store, "_next_prune", 0.0)
    monkeypatch.setattr(store, "_pruning", None)


@pytest.mark.django_db
def test_the_command_deletes_runs_older_than_n_days_and_a_dry_run_only_counts_them(capsys, client):
    old, older, recent = aged(31), aged(400), aged(29)
    call_command("prune_generations", "--older-than-days", "30", "--dry-run")
    assert "2 generation(s) older than 30 days would be deleted" in capsys.readouterr().out
    assert Generation.objects.count() == 3

    call_command("prune_generations", "--older-than-days", "30")
    assert "deleted 2 generation(s)" in capsys.readouterr().out
    assert list(Generation.objects.values_list("pk", flat=True)) == [recent.pk]
    # a pruned run's link gets the site's usual 404 page
    response = client.get(old.get_absolute_url())
    assert response.status_code == 404 and "Nothing here" in response.content.decode()
    assert client.get(older.get_absolute_url()).status_code == 404
    assert client.get(recent.get_absolute_url()).status_code == 200

    with pytest.raises(CommandError, match="0 or more"):
        call_command("prune_generations", "--older-than-days", "-1")
    # 0 keeps them all as PLAYGROUND_RETENTION_DAYS, and deletes them all here: only when meant
    with pytest.raises(CommandError, match="add --all to mean it"):
        call_command("prune_generations", "--older-than-days", "0")
    call_command("prune_generations", "--older-than-days", "0", "--dry-run")  # counting is no slip
    assert Generation.objects.count() == 1
    call_command("prune_generations", "--older-than-days", "0", "--all")
    assert Generation.objects.count() == 0
    with pytest.raises(CommandError):
        call_command("prune_generations")  # no default: the number of days is the caller's choice


def test_the_retention_is_30_days_by_default_0_keeps_everything_else_a_whole_number_of_days(monkeypatch):
    monkeypatch.delenv("PLAYGROUND_RETENTION_DAYS", raising=False)
    assert retention_days() == 30  # a public demo's database stays bounded unless asked otherwise
    monkeypatch.setenv("PLAYGROUND_RETENTION_DAYS", " 7 ")
    assert retention_days() == 7
    monkeypatch.setenv("PLAYGROUND_RETENTION_DAYS", "0")
    assert retention_days() is None
    for wrong in ("-3", "1.5", "a month"):
        monkeypatch.setenv("PLAYGROUND_RETENTION_DAYS", wrong)
        with pytest.raises(ImproperlyConfigured, match="PLAYGROUND_RETENTION_DAYS"):
            retention_days()


@pytest.mark.django_db(transaction=True)
async def test_with_a_retention_the_web_process_prunes_after_a_save_at_most_hourly(settings, fresh_process):
    settings.PLAYGROUND_RETENTION_DAYS = 30
    old = await asyncio.to_thread(aged, 45)
    new = await save_generation(JobSpec(model="m", prompt="first"), DONE)
    await store._pruning  # the first save of a process prunes, in the background
    assert not await Generation.objects.filter(pk=old.pk).aexists()
    assert await Generation.objects.filter(pk=new.pk).aexists()

    another_old = await asyncio.to_thread(aged, 45)
    await save_generation(JobSpec(model="m", prompt="second"), DONE)
    assert store._pruning.done()  # within the hour: no new prune
    assert await Generation.objects.filter(pk=another_old.pk).aexists()

    assert store._next_prune - time.monotonic() > 3590  # the next one is an hour after the first
    store._next_prune = time.monotonic()  # ... which has now passed
    await save_generation(JobSpec(model="m", prompt="third"), DONE)
    await store._pruning
    assert not await Generation.objects.filter(pk=another_old.pk).aexists()
    assert await Generation.objects.acount() == 3


@pytest.mark.django_db(transaction=True)
async def test_a_save_never_waits_for_the_prune(settings, fresh_process, monkeypatch):
    settings.PLAYGROUND_RETENTION_DAYS = 30
    pruned = []

    def slow_prune(days, dry_run=False):
        time.sleep(1.0)  # a large table on a slow disk
        pruned.append(days)
        return 0

    monkeypatch.setattr(store, "prune_generations", slow_prune)
    started = time.perf_counter()
    await save_generation(JobSpec(model="m", prompt="hello"), DONE)
    assert time.perf_counter() - started < 0.5 and pruned == []
    await store._pruning
    assert pruned == [30]


@pytest.mark.django_db(transaction=True)
async def test_without_a_retention_nothing_is_pruned(settings, fresh_process):
    settings.PLAYGROUND_RETENTION_DAYS = None
    old = await asyncio.to_thread(aged, 4000)
    await save_generation(JobSpec(model="m", prompt="hello"), DONE)
    assert store._pruning is None and await Generation.objects.filter(pk=old.pk).aexists()


@pytest.mark.django_db
def test_the_admin_shows_a_generation_read_only_and_deletes_it_for_a_takedown(admin_client, client):
    row = aged(1, prompt="p\u202eq", output="x" * 50, decode_tok_s=1234.5)
    url = f"/admin/playground/generation/{row.pk}/change/"
    page = admin_client.get(url).content.decode()
    assert 'name="_save"' not in page and 'name="_continue"' not in page  # nothing to save
    assert f'href="/admin/playground/generation/{row.pk}/delete/"' in page
    response = admin_client.post(url, {"prompt": "edited", "output": "edited"})
    assert response.status_code == 403
    row.refresh_from_db()
    assert (row.prompt, row.output) == ("p\u202eq", "x" * 50)

    listing = admin_client.get("/admin/playground/generation/").content.decode()
    assert "1,234.5 tok/s" in listing and "column-prompt_excerpt" in listing
    assert "\u202e" not in listing and "U+202E" in listing  # the excerpt names the control, obeys none

    admin_client.post(f"/admin/playground/generation/{row.pk}/delete/", {"post": "yes"})
    assert not Generation.objects.filter(pk=row.pk).exists()
    assert client.get(row.get_absolute_url()).status_code == 404


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_serving_web_process_prunes_by_default_without_a_save(start_web):
    import subprocess
    import sys

    from tests.support import ROOT

    first = start_web()  # migrates the database; stopped again, to leave an old run in it
    first.stop()
    count = "from playground.models import Generation as G; print(G.objects.count())"
    shell = [sys.executable, "manage.py", "shell", "--verbosity", "0", "-c"]
    plant = (
        "from datetime import timedelta; from django.utils import timezone; "
        "from playground.models import Generation as G; "
        "old = G.objects.create(job_id='old-run', model='m', prompt='p', output='o', finish_reason='stop'); "
        "G.objects.filter(pk=old.pk).update(created=timezone.now() - timedelta(days=31)); "
        "G.objects.create(job_id='new-run', model='m', prompt='p', output='o', finish_reason='stop')"
    )
    subprocess.run([*shell, plant], cwd=ROOT, env=first.env, check=True, capture_output=True)
    start_web()  # PLAYGROUND_RETENTION_DAYS unset: 30 days; its first request (the page) prunes
    deadline = time.monotonic() + 30
    while (left := subprocess.run([*shell, count], cwd=ROOT, env=first.env, capture_output=True, text=True)
           ).stdout.strip() != "1":  # fmt: skip
        assert time.monotonic() < deadline, left.stdout + left.stderr
        time.sleep(0.5)
