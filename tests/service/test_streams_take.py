"""StreamConsumer.take, the one read loop of the workers, against a real Redis: a batch the server
delivered but the client lost (a client-side timeout) is handled by the next read, not after a
day-long re-claim idle time; Redis going away never raises out of take; stop ends the wait."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from shellrl.contract import Trajectory
from shellrl.streams import STREAM_DEAD, OutgoingEntry, StreamConsumer, StreamProducer, connect
from tests.fakes.lossy_redis import LosesDeliveredBatches

STREAM, GROUP = "shellrl:episodes", "verifier"
DAY_MS = 86_400_000


def _entries(n: int, payload_bytes: int = 0) -> list[OutgoingEntry]:
    pad = "x" * payload_bytes
    return [
        OutgoingEntry(
            Trajectory(trajectory_id=f"t{i:04d}", task_id=pad).SerializeToString(), f"t{i:04d}"
        )
        for i in range(n)
    ]


async def test_a_delivered_batch_lost_by_the_client_is_handled_by_the_next_take(redis_server):
    n = 200
    redis = connect(redis_server.url)
    setup = StreamConsumer(redis, STREAM, GROUP, "setup")
    await setup.ensure_group()
    await StreamProducer(redis, STREAM).add_many(_entries(n, payload_bytes=20_000))

    consumer = StreamConsumer(
        redis, STREAM, GROUP, "verifier-1", count=n, claim_min_idle_ms=DAY_MS, max_deliveries=2
    )
    handled = [
        e.entry_id for e in await consumer.read(count=1, block_ms=0)
    ]  # past the start-up read
    await consumer.ack(*handled)
    consumer.redis = LosesDeliveredBatches(redis, failures=3)
    stop = asyncio.Event()
    started = time.monotonic()
    while len(handled) < n and time.monotonic() - started < 30:
        for entry in await consumer.take(stop, n):
            handled.append(entry.entry_id)
            await consumer.ack(entry.entry_id)
    assert len(handled) == len(set(handled)) == n, "every delivered entry handled exactly once"
    assert time.monotonic() - started < 30
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0
    assert await redis.xlen(STREAM_DEAD) == 0, "nothing healthy reaches the dead letters"
    await redis.aclose()


async def test_lost_replies_are_no_handling_attempts_and_held_entries_are_not_handed_out_twice(
    redis_server,
):
    """Redis counts every delivery, also those whose reply the client lost: six lost replies would
    dead-letter a healthy entry at max_deliveries 5. Only entries handed to the caller count; an
    entry this consumer still holds (a learner waiting for its checkpoint) is not handed out again
    by the re-reads of its own pending list."""
    redis = connect(redis_server.url)
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "learner-1", count=4, claim_min_idle_ms=DAY_MS, max_deliveries=5
    )
    await consumer.ensure_group()
    await StreamProducer(redis, STREAM).add_many(_entries(2))
    held = await consumer.read(count=1, block_ms=0)  # handed out, not acknowledged yet
    assert [e.deliveries for e in held] == [1]
    faulty = LosesDeliveredBatches(redis, failures=0)
    consumer.redis = faulty

    async def lose_own_pending_reads(group, name, streams, **kwargs):  # also lose the PEL re-reads
        await redis.xreadgroup(group, name, streams, **kwargs)
        raise RedisTimeoutError("Timeout reading from socket")

    faulty.xreadgroup = lose_own_pending_reads
    stop = asyncio.Event()
    for _ in range(6):
        with pytest.raises(RedisTimeoutError):
            await consumer.read(count=4, block_ms=0)
        consumer._recovered = False  # what take() does after a failed read
    consumer.redis = redis
    (second,) = await consumer.take(stop, 4)  # the lost one, once, counted once
    assert second.deliveries == 1 and second.entry_id != held[0].entry_id
    assert await consumer.take(stop, 4) == []  # the held entry is not handed out again
    assert await redis.xlen(STREAM_DEAD) == 0
    await consumer.ack(held[0].entry_id, second.entry_id)
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0
    await redis.aclose()


async def test_take_returns_empty_once_stop_is_set_while_redis_is_down(redis_server):
    redis = connect(redis_server.url)
    consumer = StreamConsumer(redis, STREAM, GROUP, "verifier-1")
    await consumer.ensure_group()
    redis_server.stop()
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.take(stop, 4))
    await asyncio.sleep(1.5)  # a few failed reads with backoff; take keeps trying, never raises
    assert not task.done()
    stop.set()
    assert await asyncio.wait_for(task, 15) == []
    await redis.aclose()


async def test_pending_entries_trimmed_away_are_counted_and_logged_as_lost(redis_server, caplog):
    from shellrl.streams.keys import lost_key
    from shellrl.streams.metrics import LOST

    stream = "shellrl:test-lost"
    redis = connect(redis_server.url)
    owner = StreamConsumer(redis, stream, GROUP, "owner")
    await owner.ensure_group()
    await StreamProducer(redis, stream).add_many(_entries(5))
    delivered = await owner.read(count=5, block_ms=0)
    assert len(delivered) == 5
    await redis.xtrim(stream, maxlen=0)  # a trim that ignores the group (not trim_acknowledged)
    before = LOST.labels(stream, GROUP)._value.get()

    claimer = StreamConsumer(redis, stream, GROUP, "claimer", claim_min_idle_ms=0)
    assert await claimer.claim_idle(10) == []  # XAUTOCLAIM reports the 5 ids as deleted
    assert LOST.labels(stream, GROUP)._value.get() - before == 5
    assert await redis.hget(lost_key(stream), GROUP) == b"5"  # what `shellrl status` shows
    assert "trimmed before they were handled" in caplog.text
    assert (await redis.xpending(stream, GROUP))["pending"] == 0
    await redis.aclose()
