"""Claim idle times against handling times (issue 15, fault 1), on a real Redis: a live consumer's
entries are never re-claimed however long it handles them (it renews them), a dead consumer's come
back after `claim_min_idle_ms`; and the verifier's and the gateway's consumers handle every entry
exactly once, within a bounded time, after reads whose delivered batch the client lost, with large
entries, a busy event loop and a second replica running on the services' default claim settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import pytest

from services.rollout.settings import RolloutSettings
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from services.verifier.parts import build_verifier
from services.verifier.settings import VerifierSettings
from services.verifier.worker import VerifierWorker
from shellrl.contract import EpisodeEnd, Task, Trajectory, task_from_json
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import (
    GROUP_VERIFIER,
    STREAM_DEAD,
    STREAM_EPISODES,
    STREAM_EVALUATIONS,
    STREAM_TASKS,
    STREAM_TRAJECTORIES,
    OutgoingEntry,
    StreamConsumer,
    StreamProducer,
    connect,
)
from shellrl.streams.keys import ORDER_KEY, POOL_KEY, attempts_key
from tests.fakes.lossy_redis import LosesDeliveredBatches
from tests.fakes.slow_verifier import SlowVerifier
from tests.helpers.waiting import wait_until_async

PAD_CHARS = 16_000  # large entries: each reply of a read is several hundred KB


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


@contextlib.asynccontextmanager
async def busy_loop(block_s: float = 0.05, every_s: float = 0.1):
    """A neighbour on the event loop that blocks it for `block_s` every `every_s` seconds."""

    async def hog():
        while True:
            time.sleep(block_s)
            await asyncio.sleep(every_s)

    task = asyncio.create_task(hog())
    try:
        yield
    finally:
        await cancel_and_wait(task)


async def test_a_live_consumer_keeps_entries_it_renews_and_a_dead_ones_come_back(redis):
    stream, group = "shellrl:test-renew", "g"
    holder = StreamConsumer(redis, stream, group, "holder", claim_min_idle_ms=400)
    other = StreamConsumer(redis, stream, group, "other", claim_min_idle_ms=400)
    await holder.ensure_group()
    await StreamProducer(redis, stream).add_many([OutgoingEntry(b"x", f"k{i}") for i in range(3)])
    held = await holder.read(count=3, block_ms=0)
    assert len(held) == 3
    renewing = asyncio.create_task(holder.keep_renewed())  # every 100 ms
    try:
        for _ in range(6):  # 1.2 s: three times the claim idle time
            await asyncio.sleep(0.2)
            assert await other.claim_idle(10) == [], "a live consumer's entry was re-claimed"
    finally:
        await cancel_and_wait(renewing)
    await asyncio.sleep(0.6)  # the holder is gone: its entries idle past claim_min_idle_ms
    taken = await other.claim_idle(10)
    assert sorted(e.entry_id for e in taken) == sorted(e.entry_id for e in held)
    assert {e.deliveries for e in taken} == {2}, "renewals are no handling attempts"


async def test_a_renewal_leaves_an_entry_another_consumer_re_claimed_with_that_one(redis):
    stream, group = "shellrl:test-renew-owner", "g"
    holder = StreamConsumer(redis, stream, group, "holder", claim_min_idle_ms=60_000)
    thief = StreamConsumer(redis, stream, group, "thief", claim_min_idle_ms=0)
    await holder.ensure_group()
    await StreamProducer(redis, stream).add(b"x", idempotency_key="k")
    (entry,) = await holder.read(count=1, block_ms=0)
    assert [e.entry_id for e in await thief.claim_idle(1)] == [entry.entry_id]
    assert await holder.renew() == 0
    (pending,) = await redis.xpending_range(stream, group, "-", "+", 1)
    assert pending["consumer"] == b"thief"


def _episode(i: int, task: Task) -> Trajectory:
    return Trajectory(
        trajectory_id=f"t{i:03d}",
        task_id=task.task_id,
        group_id=f"g{i // 2}",
        task=task,
        answer="5",
        end=EpisodeEnd.EPISODE_END_ANSWER,
    )


async def test_the_verifier_handles_each_entry_once_after_lost_reads_however_long_it_verifies(
    redis,
):
    """Two verifier replicas on one claim idle time (short, so the test is quick; the rule does
    not depend on it); each verification takes 2.5 claim idle times, the first replica's client
    loses its first three delivered batches, and a neighbour keeps the loop busy. The idle time
    leaves 1.5 s between renewals (every 0.5 s) and a re-claim: at 0.8 s a machine at load 7 on 2
    cores stalled the process long enough for the other replica to re-claim held entries."""
    n, claim_min_idle_ms = 24, 2000
    task = task_from_json(
        {
            "task_id": "t-five",
            "instruction": "Say 5. " + "x" * PAD_CHARS,
            "check": {"type": "answer_integer_equals", "expected": 5},
        }
    )
    producer = StreamProducer(redis, STREAM_EPISODES)
    await StreamConsumer(redis, STREAM_EPISODES, GROUP_VERIFIER, "setup").ensure_group()
    await producer.add_many(
        [OutgoingEntry(_episode(i, task).SerializeToString(), f"t{i:03d}") for i in range(n)]
    )
    settings = VerifierSettings(claim_min_idle_ms=claim_min_idle_ms)
    handled: Counter[str] = Counter()
    workers = []
    for name, lost_reads in (("verifier-a", 3), ("verifier-b", 0)):
        consumer = StreamConsumer(
            redis,
            STREAM_EPISODES,
            GROUP_VERIFIER,
            name,
            block_ms=200,
            count=settings.read_count,
            claim_min_idle_ms=settings.claim_min_idle_ms,
            claim_interval_s=0.2,
            max_deliveries=settings.max_deliveries,
        )
        consumer.redis = LosesDeliveredBatches(redis, failures=lost_reads)
        worker = VerifierWorker(
            consumer,
            StreamProducer(redis, STREAM_TRAJECTORIES),
            StreamProducer(redis, STREAM_EVALUATIONS),
            SlowVerifier(build_verifier(settings, sandbox=None), delay_s=5.0),
            None,
            concurrency=8,
        )
        worker.handle = _counting(worker.handle, handled)
        workers.append(worker)
    stop = asyncio.Event()
    async with busy_loop():
        runs = [asyncio.create_task(w.run(stop)) for w in workers]
        try:
            await wait_until_async(
                lambda: _stream_has(redis, STREAM_TRAJECTORIES, n),
                timeout_s=90,
                what=f"{n} verified trajectories",
            )
        finally:
            stop.set()
            for w in workers:
                await w.drain(5.0)
            await cancel_and_wait(*runs)
    assert len(handled) == n and set(handled.values()) == {1}, f"handled: {handled}"
    assert (await redis.xpending(STREAM_EPISODES, GROUP_VERIFIER))["pending"] == 0
    assert await redis.xlen(STREAM_DEAD) == 0, "nothing healthy reaches the dead letters"
    assert await redis.hlen(attempts_key(STREAM_EPISODES, GROUP_VERIFIER)) == 0


async def test_the_gateway_pool_feeder_handles_each_task_once_after_lost_reads(redis):
    """The gateway's consumer of shellrl:tasks on its default claim idle time, next to a second
    replica: large tasks, three lost batches, a busy loop; every task joins the epoch once."""
    n = 60
    store = TaskStore(redis)
    settings = RolloutSettings()
    tasks = [
        task_from_json(
            {
                "task_id": f"task-{i:03d}",
                "instruction": f"Say {i}. " + "x" * PAD_CHARS,
                "check": {"type": "answer_integer_equals", "expected": i},
            }
        )
        for i in range(n)
    ]
    handled: Counter[str] = Counter()
    pools = []
    for name, lost_reads in (("rollout-a", 3), ("rollout-b", 0)):
        pool = TaskPool(redis, store, consumer=name, claim_min_idle_ms=settings.claim_min_idle_ms)
        pool.consumer.count = 8  # several batches, so that lost ones leave work for later reads
        pool.consumer.redis = LosesDeliveredBatches(redis, failures=lost_reads)
        pool._handle = _counting(pool._handle, handled)
        pools.append(pool)
    await pools[0].consumer.ensure_group()
    producer = StreamProducer(redis, STREAM_TASKS)
    await producer.add_many([OutgoingEntry(t.SerializeToString(), t.task_id) for t in tasks])
    stop = asyncio.Event()
    started = time.monotonic()
    async with busy_loop():
        feeds = [asyncio.create_task(p.feed(stop)) for p in pools]
        try:
            await wait_until_async(
                lambda: _all_acknowledged(redis, n), timeout_s=60, what="every task acknowledged"
            )
        finally:
            stop.set()
            await cancel_and_wait(*feeds)
    # bounded by the next read after a lost one (0.5 s backoff), not by the 30 s claim idle time
    assert time.monotonic() - started < settings.claim_min_idle_ms / 1000
    assert len(handled) == n and set(handled.values()) == {1}, f"handled: {handled}"
    order = [raw.decode() for raw in await redis.lrange(ORDER_KEY, 0, -1)]
    assert sorted(order) == [t.task_id for t in tasks], "each task once in the epoch order"
    assert await redis.scard(POOL_KEY) == n
    assert await redis.xlen(STREAM_DEAD) == 0


def _counting(handle, counts: Counter):
    async def counted(entry):
        counts[entry.entry_id] += 1
        return await handle(entry)

    return counted


async def _stream_has(redis, stream: str, n: int) -> bool:
    return await redis.xlen(stream) >= n


async def _all_acknowledged(redis, n: int) -> bool:
    groups = await redis.xinfo_groups(STREAM_TASKS)
    return (
        bool(groups)
        and groups[0]["pending"] == 0
        and groups[0]["lag"] == 0
        and await redis.scard(POOL_KEY) == n
    )
