"""The Redis job protocol on a real Redis server: queue order, positions, cancel, lost workers, resume."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis
import redis.asyncio as aioredis

from common import protocol
from common.protocol import (
    JobClient,
    JobSpec,
    QueueFull,
    WorkerChannel,
    events_key,
    job_key,
    queue_key,
    worker_key,
    workers_key,
)


@pytest.fixture
async def client(redis_url):
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield JobClient(r, max_queue=3)
    await r.aclose()


@pytest.fixture
def channel(redis_url):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    channel = WorkerChannel(r, "w1", ["m"])
    yield channel
    channel.retire()  # later tests share this Redis: leave no live-looking worker behind
    r.close()


async def collect(
    client: JobClient, job_id: str, after: str = "0-0", limit: int = 100, known: bool = False
) -> list:
    out = []
    async for item in client.events(job_id, after=after, block_ms=50, known=known):
        out.append(item)
        if len(out) >= limit:
            break
    return out


async def test_fifo_positions_and_bounded_queue(client, channel):
    ids = [await client.submit(JobSpec(model="m", prompt=f"p{i}")) for i in range(3)]
    assert [await client.position(i, "m") for i in ids] == [0, 1, 2]
    with pytest.raises(QueueFull, match="full"):
        await client.submit(JobSpec(model="m", prompt="one too many"))
    channel.heartbeat({})
    taken = channel.next_job(timeout_s=0.1)
    assert taken.id == ids[0] and taken.prompt == "p0"
    assert [await client.position(i, "m") for i in ids] == [None, 0, 1]
    assert (await client.status(ids[0]))["status"] == "running"


async def test_events_resume_from_any_entry_without_gap_or_duplicate(client, channel):
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    channel.heartbeat({})
    channel.next_job(timeout_s=0.1)
    for i in range(5):
        channel.publish(job_id, "delta", {"text": str(i)})
    channel.finish(job_id, "done", {"finish_reason": "length", "text": "01234"})
    everything = await collect(client, job_id)
    assert [t for _, t, _ in everything] == ["started"] + ["delta"] * 5 + ["done"]
    cut = everything[2][0]  # resume after the second delta ("1")
    rest = await collect(client, job_id, after=cut)
    assert [d["text"] for _, t, d in rest if t == "delta"] == ["2", "3", "4"]
    assert (await client.status(job_id))["status"] == "done"


async def test_cancel_queued_job_leaves_queue_and_ends_stream(client):
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    await client.cancel(job_id)
    assert await client.position(job_id, "m") is None
    events = await collect(client, job_id)
    assert events[-1][1] == "done" and events[-1][2]["finish_reason"] == "cancelled"


async def test_running_job_sees_cancel_flag(client, channel):
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    channel.heartbeat({})
    channel.next_job(timeout_s=0.1)
    assert not channel.cancelled(job_id)
    await client.cancel(job_id)
    assert channel.cancelled(job_id)


async def test_dead_worker_turns_into_error_event(client, channel, redis_url):
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    channel.heartbeat({})
    channel.next_job(timeout_s=0.1)
    channel.publish(job_id, "delta", {"text": "partial"})
    channel.retire()  # the heartbeat vanishes as if the worker had died
    events = await asyncio.wait_for(collect(client, job_id), timeout=5)
    assert events[-1][1] == "error"
    assert events[-1][2]["code"] == "worker_lost"
    assert (await client.status(job_id))["status"] == "error"
    # A second reader sees the same single error, not a second one.
    again = await collect(client, job_id)
    assert [t for _, t, _ in again].count("error") == 1


async def test_a_job_that_waited_long_in_the_queue_is_not_lost_when_a_worker_pops_it(
    client, channel, redis_url, monkeypatch
):
    # The reader has waited past LOST_CLAIM_S behind other jobs when a worker pops this one; the worker's
    # claim comes a moment later. That moment is not a lost claim (it was, when the clock started with
    # the reader rather than with the pop: a spurious worker_lost while the worker generated anyway).
    monkeypatch.setattr(protocol, "LOST_CLAIM_S", 1.0)
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    channel.heartbeat({})
    reader = asyncio.create_task(collect(client, job_id))
    await asyncio.sleep(1.5)  # queued all along: longer than LOST_CLAIM_S
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.lpop(queue_key("m")) == job_id  # the worker's pop ...
    await asyncio.sleep(0.6)  # ... several of the reader's polls before its claim
    assert channel.claim(job_id).id == job_id
    channel.finish(job_id, "done", {"finish_reason": "length", "text": ""})
    events = await asyncio.wait_for(reader, timeout=5)
    assert [t for _, t, _ in events if t != "queue"] == ["started", "done"]
    assert (await client.status(job_id))["status"] == "done"
    r.close()


async def test_a_popped_job_never_claimed_is_lost_and_a_late_claim_skips_it(
    client, channel, redis_url, monkeypatch
):
    monkeypatch.setattr(protocol, "LOST_CLAIM_S", 0.3)
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    channel.heartbeat({})
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.lpop(queue_key("m")) == job_id  # a worker popped it and died before its claim
    events = await asyncio.wait_for(collect(client, job_id), timeout=5)
    assert events[-1][1] == "error" and events[-1][2]["code"] == "worker_lost"
    assert channel.claim(job_id) is None  # a worker that comes back to it leaves it alone
    assert (await client.status(job_id))["status"] == "error"
    assert [t for _, t, _ in await collect(client, job_id)].count("started") == 0
    r.close()


async def test_a_job_its_live_worker_no_longer_names_is_lost_and_the_worker_then_writes_nothing(
    client, channel, monkeypatch
):
    # The worker dropped the job (Redis failed under it) or a worker of the same id restarted: the
    # heartbeat lives on and names no job. Without this the reader waited for ever.
    monkeypatch.setattr(protocol, "DROPPED_JOB_S", 0.5)
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    channel.heartbeat({})
    channel.next_job(timeout_s=0.1)
    channel.heartbeat({"job": job_id})
    channel.publish(job_id, "delta", {"text": "a"})
    reader = asyncio.create_task(collect(client, job_id))
    await asyncio.sleep(1.0)
    assert not reader.done()  # named by its worker: waits, however long the step
    channel.heartbeat({"job": None})
    events = await asyncio.wait_for(reader, timeout=5)
    assert events[-1][1] == "error" and events[-1][2]["code"] == "worker_lost"
    assert "dropped" in events[-1][2]["message"]
    # The worker, should it still be at it, is told to stop and cannot write past the end.
    assert channel.cancelled(job_id)
    assert channel.publish(job_id, "delta", {"text": "late"}) is None
    assert channel.finish(job_id, "done", {"finish_reason": "length", "text": "a"}) is False
    assert (await client.status(job_id))["status"] == "error"


async def test_a_queued_job_no_worker_serves_is_turned_away_and_leaves_the_queue(
    client, channel, monkeypatch
):
    monkeypatch.setattr(protocol, "NO_WORKER_WAIT_S", 0.5)
    job_id = await client.submit(JobSpec(model="m", prompt="x"))
    events = await asyncio.wait_for(collect(client, job_id), timeout=5)
    assert events[0] == ("", "queue", {"position": 0, "workers": 0, "wait_s": None})
    assert events[-1][1] == "error" and events[-1][2]["code"] == "no_workers"
    assert await client.position(job_id, "m") is None  # no worker that starts later runs it for nobody


async def test_a_queued_job_waits_while_a_worker_serves_its_model(client, channel, monkeypatch):
    monkeypatch.setattr(protocol, "NO_WORKER_WAIT_S", 0.3)
    await client.submit(JobSpec(model="m", prompt="first"))
    job_id = await client.submit(JobSpec(model="m", prompt="second"))
    channel.heartbeat({"job": "another"})  # up and busy: the job waits its turn
    reader = asyncio.create_task(collect(client, job_id))
    await asyncio.sleep(1.0)
    assert not reader.done() and await client.position(job_id, "m") == 1
    reader.cancel()


@pytest.mark.parametrize(
    "spec_json, why",
    [
        ("this is not json", "Expecting value"),
        ('["a list"]', "JSON object"),
        ('{"model": "m", "prompt": "x", "created": "yesterday"}', "created"),
        ('{"model": "m", "prompt": "x", "params": "hot"}', "params"),
        ('{"model": "m", "prompt_ids": []}', "prompt_ids must be a list of 1 to 1,048,576 integers >= 0"),
        ('{"model": "m", "prompt_ids": [5, -1]}', "prompt_ids"),
        ('{"model": "m", "prompt_ids": [5, true]}', "prompt_ids"),
        ('{"model": "m", "prompt_ids": "5 6"}', "prompt_ids"),
        (json.dumps({"model": "m", "prompt_ids": [1] * (protocol.MAX_PROMPT_IDS + 1)}), "prompt_ids"),
    ],
)
async def test_an_unreadable_job_is_ended_and_the_worker_takes_the_next(
    client, channel, redis_url, spec_json, why
):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.hset(job_key("bad"), mapping={"spec": spec_json, "status": "queued", "model": "m", "created": 0})
    r.rpush(queue_key("m"), "bad")
    good = await client.submit(JobSpec(model="m", prompt="fine"))
    channel.heartbeat({})
    assert channel.next_job(timeout_s=0.1) is None  # the bad one, ended
    assert channel.next_job(timeout_s=0.1).id == good
    [(_, fields)] = r.xrange(events_key("bad"))
    assert fields["type"] == "error" and why in fields["data"]
    assert r.hget(job_key("bad"), "status") == "error"
    r.close()


def test_a_spec_from_a_newer_web_process_is_read_without_its_new_fields():
    spec = JobSpec(model="m", prompt="x")
    newer = json.dumps({**json.loads(spec.to_json()), "priority": 3})
    assert JobSpec.from_json(newer) == spec


async def test_queue_event_reports_position_and_workers(client, channel):
    first = await client.submit(JobSpec(model="m", prompt="a"))
    second = await client.submit(JobSpec(model="m", prompt="b"))
    channel.heartbeat({})
    events = client.events(second, block_ms=50)
    _, kind, data = await events.__anext__()
    assert kind == "queue" and data == {"position": 1, "workers": 1, "wait_s": None}
    await events.aclose()
    assert first != second


async def test_a_worker_is_listed_exactly_while_its_heartbeat_lives(client, channel, redis_url, monkeypatch):
    # A heartbeat that retried through a Redis restart lands with the time it was begun at, seconds old; the
    # worker is back all the same and must be listed (it was not, until its next beat: "available: none").
    stale = time.time() - 10
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: stale)
        channel.heartbeat({})
    assert [beat["id"] for beat in await client.workers()] == ["w1"]
    # A worker that died without retiring drops out once its key expires, and leaves the registry with it.
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.pexpire(worker_key("w1"), 50)
    await asyncio.sleep(0.2)
    assert await client.workers() == []
    assert r.zrange(workers_key(), 0, -1) == []
    r.close()


def test_a_prompt_of_token_ids_travels_as_it_was_given():
    spec = JobSpec(model="m", prompt_ids=[0, 7, 7, 1023], params={"max_new_tokens": 2})
    assert JobSpec.from_json(spec.to_json()) == spec  # prompt_ids included, in their order


def test_sampling_params_roundtrip_through_spec():
    spec = JobSpec(model="m", prompt="x", params={"temperature": 0.5, "stop": ["\n\n"], "seed": 3})
    params = JobSpec.from_json(spec.to_json()).sampling_params()
    assert params.temperature == 0.5 and params.stop == ("\n\n",) and params.seed == 3


# ---- leases: a job nobody follows is ended by its worker -------------------------------------------


async def test_a_running_job_whose_leases_lapsed_past_its_grace_is_stopped_by_the_worker_check(
    client, channel, monkeypatch
):
    monkeypatch.setattr(protocol, "LEASE_TTL_S", 0.3)
    job_id = await client.submit(JobSpec(model="m", prompt="x"), follower="page", grace_s=0.4)
    channel.heartbeat({})
    assert channel.next_job(timeout_s=0.1).id == job_id
    for _ in range(6):  # renewed: followed for as long as the follower says so, past TTL and grace
        await asyncio.sleep(0.2)
        assert await client.lease(job_id, "page")
        assert channel.cancelled(job_id) is None
    await asyncio.sleep(0.5)  # lapsed (0.3 s), within the grace (0.4 s more): a reload may still come
    assert not await client.followed(job_id) and channel.cancelled(job_id) is None
    await asyncio.sleep(0.4)
    assert channel.cancelled(job_id) == "orphaned"
    # the worker ends it as cancelled, like any stopped job; the lease is gone with it
    assert channel.finish(job_id, "done", {"finish_reason": "cancelled", "text": "", "stats": None})
    assert (await client.status(job_id))["status"] == "cancelled"
    assert not await client.lease(job_id, "late")  # a job that has ended holds no lease


async def test_a_follower_that_leaves_starts_the_grace_at_once_and_another_keeps_the_job(
    client, channel, monkeypatch
):
    monkeypatch.setattr(protocol, "LEASE_TTL_S", 5.0)
    job_id = await client.submit(JobSpec(model="m", prompt="x"), follower="a", grace_s=0.3)
    channel.heartbeat({})
    channel.next_job(timeout_s=0.1)
    assert await client.lease(job_id, "b")  # a second follower (a page on another web process)
    await client.release(job_id, "a")
    await asyncio.sleep(0.5)
    assert await client.followed(job_id) and channel.cancelled(job_id) is None  # b's lease holds it
    await client.release(job_id, "b")
    assert not await client.followed(job_id)
    assert channel.cancelled(job_id) is None  # within the grace
    await asyncio.sleep(0.4)
    assert channel.cancelled(job_id) == "orphaned"


async def test_a_queued_job_nobody_follows_any_more_is_ended_cancelled_instead_of_started(
    client, channel, monkeypatch
):
    monkeypatch.setattr(protocol, "LEASE_TTL_S", 0.2)
    orphan = await client.submit(JobSpec(model="m", prompt="x"), follower="api", grace_s=0)
    kept = await client.submit(JobSpec(model="m", prompt="y"), follower="page", grace_s=0)
    untracked = await client.submit(JobSpec(model="m", prompt="z"))  # no lease: never orphaned
    await asyncio.sleep(0.4)
    assert await client.lease(kept, "page")
    channel.heartbeat({})
    assert channel.next_job(timeout_s=0.1) is None  # the orphan, ended unstarted
    assert channel.next_job(timeout_s=0.1).id == kept
    assert channel.next_job(timeout_s=0.1).id == untracked
    events = await collect(client, orphan)
    assert [(t, d["finish_reason"]) for _, t, d in events] == [("done", "cancelled")]
    assert (await client.status(orphan))["status"] == "cancelled"
    assert channel.cancelled(untracked) is None


async def test_a_full_queue_lets_go_of_the_jobs_nobody_follows_before_it_turns_one_away(
    client, channel, monkeypatch
):
    # a web process SIGKILLed with jobs queued: their leases lapse, and they must not hold the queue's places
    # until a worker pops them (with no worker up, that is never)
    monkeypatch.setattr(protocol, "LEASE_TTL_S", 0.2)
    orphans = [await client.submit(JobSpec(model="m", prompt=f"o{i}"), follower=f"dead{i}", grace_s=0.1)
               for i in range(2)]  # fmt: skip
    untracked = await client.submit(JobSpec(model="m", prompt="u"))  # no lease: never orphaned
    with pytest.raises(QueueFull):  # within the leases and the grace, the queue is still full
        await client.submit(JobSpec(model="m", prompt="early"))
    await asyncio.sleep(0.5)
    fresh = await client.submit(JobSpec(model="m", prompt="fresh"), follower="live", grace_s=5)
    assert [await client.position(job_id, "m") for job_id in (*orphans, untracked, fresh)] == [
        None,
        None,
        0,
        1,
    ]
    for orphan in orphans:  # ended as a worker would have ended them on popping them
        events = await collect(client, orphan)
        assert [(t, d["finish_reason"]) for _, t, d in events] == [("done", "cancelled")]
        assert (await client.status(orphan))["status"] == "cancelled"
    await client.submit(JobSpec(model="m", prompt="third"), follower="live2", grace_s=5)
    with pytest.raises(QueueFull):  # the untracked job and two followed ones: nothing to let go of
        await client.submit(JobSpec(model="m", prompt="fourth"))
    channel.heartbeat({})
    assert channel.next_job(timeout_s=0.1).id == untracked  # the order kept


async def test_a_reader_that_knows_its_job_reports_it_lost_to_a_restart_not_unknown(client):
    # A queued job has no event yet: after a Redis restart emptied it, a reader that submitted it (or saw
    # its record) must say the queue restarted, and write nothing into the new Redis.
    job_id = "0123456789abcdef0123456789abcdef"
    events = await asyncio.wait_for(collect(client, job_id, known=True), timeout=5)
    assert [(t, d["code"]) for _, t, d in events] == [("error", "queue_restarted")]
    assert not await client.r.exists(job_key(job_id), events_key(job_id))
    # an id nobody vouches for is still an unknown job
    events = await asyncio.wait_for(collect(client, job_id), timeout=5)
    assert events[-1][2]["code"] == "unknown_job"


async def test_visitors_are_served_in_turn_and_each_holds_at_most_its_share(redis_url, channel):
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    client = JobClient(r, max_per_visitor=2)
    a1, a2 = [await client.submit(JobSpec(model="m", prompt=f"a{i}"), visitor="ip:a") for i in (1, 2)]
    with pytest.raises(protocol.VisitorBusy, match="2 generations queued or running"):
        await client.submit(JobSpec(model="m", prompt="a3"), visitor="ip:a")
    b1, b2 = [await client.submit(JobSpec(model="m", prompt=f"b{i}"), visitor="ip:b") for i in (1, 2)]
    probe = await client.submit(JobSpec(model="m", prompt="probe"))  # no visitor: the round being served
    c1 = await client.submit(JobSpec(model="m", prompt="c1"), visitor="key:7")
    # round robin: each visitor's first job, then each one's second, whoever asked first
    assert await r.lrange(queue_key("m"), 0, -1) == [a1, b1, probe, c1, a2, b2]
    channel.heartbeat({})
    assert channel.next_job(timeout_s=0.1).id == a1  # running: still one of a's two
    with pytest.raises(protocol.VisitorBusy):
        await client.submit(JobSpec(model="m", prompt="a3"), visitor="ip:a")
    channel.finish(a1, "done", {"finish_reason": "stop", "text": "", "stats": None})
    a3 = await client.submit(JobSpec(model="m", prompt="a3"), visitor="ip:a")  # a1 ended: room again
    assert await r.lrange(queue_key("m"), 0, -1) == [b1, probe, c1, a2, b2, a3]
    await r.aclose()


async def test_a_queued_job_hears_its_estimated_wait_from_the_models_measured_job_length(client, channel):
    channel.heartbeat({"job": "another"})  # the model's one worker, busy
    ids = [await client.submit(JobSpec(model="m", prompt=f"p{i}")) for i in range(2)]
    first = await collect(client, ids[1], limit=1)
    assert first == [("", "queue", {"position": 1, "workers": 1, "wait_s": None})]  # nothing measured yet
    await client.record_speed("m", {"decode_tok_s": 100.0, "total_ms": 4000.0})
    await client.record_speed("m", {"decode_tok_s": 100.0, "total_ms": 9000.0})  # averaged: 5 s a job
    assert await client.speed("m") == {"tok_s": 100.0, "job_s": 5.0}
    first = await collect(client, ids[1], limit=1)
    assert first == [
        ("", "queue", {"position": 1, "workers": 1, "wait_s": 10.0})
    ]  # the one ahead, the running one
