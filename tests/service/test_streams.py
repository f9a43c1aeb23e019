"""Stream rules against a real redis-server: idempotency, dead letters, trimming, backpressure,
the blocking-read rule."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shellrl.contract import ContractError, Trajectory, parse_trajectory
from shellrl.streams import (
    STREAM_DEAD,
    OutgoingEntry,
    StreamConsumer,
    StreamProducer,
    connect,
)

STREAM, GROUP = "shellrl:trajectories", "learner"


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def _traj(tid: str) -> bytes:
    return Trajectory(trajectory_id=tid, task_id="t").SerializeToString()


async def _ids(redis, stream: str = STREAM) -> list[str]:
    return [eid.decode() for eid, _ in await redis.xrange(stream)]


# --- idempotent produce, atomic forward ------------------------------------------------------


async def test_add_with_the_same_idempotency_key_appends_once(redis):
    producer = StreamProducer(redis, STREAM)
    first = await producer.add(_traj("a"), idempotency_key="a", task_id="t", version=3)
    again = await producer.add(_traj("a"), idempotency_key="a", task_id="t", version=3)
    assert first[1] is False and again == (first[0], True)
    assert await redis.xlen(STREAM) == 1
    ((_, fields),) = await redis.xrange(STREAM)
    assert fields == {b"pb": _traj("a"), b"task_id": b"t", b"version": b"3"}


async def test_add_many_appends_in_order_and_skips_known_keys(redis):
    producer = StreamProducer(redis, STREAM)
    await producer.add(_traj("b"), idempotency_key="b")
    out = await producer.add_many([OutgoingEntry(_traj(t), t, {"group_id": "g"}) for t in "abc"])
    assert [dup for _, dup in out] == [False, True, False]
    assert [
        Trajectory.FromString(f[b"pb"]).trajectory_id for _, f in await redis.xrange(STREAM)
    ] == ["b", "a", "c"]


async def test_concurrent_adds_of_one_key_from_separate_clients_append_exactly_once(redis_server):
    clients = [connect(redis_server.url) for _ in range(8)]

    async def one(client, i):  # both paths: the Lua script of add, the WATCH/MULTI of add_many
        producer = StreamProducer(client, STREAM)
        if i % 2:
            return await producer.add(_traj("a"), idempotency_key="a")
        return (await producer.add_many([OutgoingEntry(_traj("a"), "a")]))[0]

    results = await asyncio.gather(*(one(c, i) for c in clients for i in range(4)))
    (first,) = [eid for eid, dup in results if not dup]
    # a duplicate sees the first id, or "" while the first add is between EXEC and recording its id
    assert {eid for eid, _ in results} <= {first, ""}
    assert await clients[0].xlen(STREAM) == 1
    for c in clients:
        await c.aclose()


async def test_a_key_repeated_inside_one_batch_is_appended_once(redis):
    out = await StreamProducer(redis, STREAM).add_many(
        [OutgoingEntry(_traj("a"), "a"), OutgoingEntry(_traj("a"), "a")]
    )
    assert out[1] == (out[0][0], True) and out[0][1] is False
    assert await redis.xlen(STREAM) == 1


async def test_forward_appends_downstream_and_acks_in_one_step_and_only_acks_a_redelivery(redis):
    upstream = StreamProducer(redis, "shellrl:episodes")
    consumer = StreamConsumer(
        redis, "shellrl:episodes", "verifier", "v1", block_ms=100, claim_interval_s=3600
    )
    await consumer.ensure_group()
    await upstream.add(_traj("a"))
    (entry,) = await consumer.read()
    downstream = StreamProducer(redis, STREAM)
    assert (await consumer.forward(entry, downstream, b"scored", idempotency_key="a"))[1] is False
    assert (await redis.xpending("shellrl:episodes", "verifier"))["pending"] == 0
    # a re-delivery of the same entry (e.g. after an AOF replay lost the ack) appends nothing
    assert (await consumer.forward(entry, downstream, b"scored", idempotency_key="a"))[1] is True
    assert await redis.xlen(STREAM) == 1


async def _failed_once(redis, stream: str):
    """A consumer of `stream` holding one entry that failed once: attempts 1, its error stored."""
    consumer = StreamConsumer(redis, stream, "verifier", "v1", block_ms=100, claim_interval_s=3600)
    await consumer.ensure_group()
    await StreamProducer(redis, stream).add(_traj("a"))
    (entry,) = await consumer.read()
    await consumer.fail(entry, "sandbox away")
    ledger = consumer._ledger
    assert await redis.hget(ledger.attempts_key, entry.entry_id) == b"1"
    assert await redis.hget(ledger.error_key, entry.entry_id) == b"sandbox away"
    return consumer, entry


async def test_forward_drops_the_entrys_delivery_bookkeeping_in_its_one_script(redis):
    consumer, entry = await _failed_once(redis, "shellrl:episodes")
    downstream = StreamProducer(redis, STREAM)
    reads = (await redis.info("stats"))["total_reads_processed"]
    await consumer.forward(entry, downstream, b"scored", idempotency_key="a")
    # one request read by the server for the forward (three before: script, HDEL, HDEL), one INFO
    assert (await redis.info("stats"))["total_reads_processed"] == reads + 2
    assert (await redis.info("commandstats"))["cmdstat_hdel"]["calls"] == 2
    assert await redis.hlen(consumer._ledger.attempts_key) == 0
    assert await redis.hlen(consumer._ledger.error_key) == 0
    assert (await redis.xpending("shellrl:episodes", "verifier"))["pending"] == 0


async def test_a_forward_whose_append_fails_leaves_the_entry_pending_with_its_bookkeeping(redis):
    consumer, entry = await _failed_once(redis, "shellrl:episodes")
    await redis.set(STREAM, "not a stream")  # XADD answers WRONGTYPE inside the script
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await consumer.forward(entry, StreamProducer(redis, STREAM), b"x", idempotency_key="a")
    assert (await redis.xpending("shellrl:episodes", "verifier"))["pending"] == 1
    assert await redis.hget(consumer._ledger.attempts_key, entry.entry_id) == b"1"
    assert await redis.hget(consumer._ledger.error_key, entry.entry_id) == b"sandbox away"
    assert await redis.get("shellrl:idem:" + STREAM + ":a") is None


# --- dead letters ---------------------------------------------------------------------------


async def test_malformed_entry_is_dead_lettered_after_n_deliveries_without_blocking_the_rest(redis):
    producer = StreamProducer(redis, STREAM)
    consumer = StreamConsumer(
        redis,
        STREAM,
        GROUP,
        "learner-1",
        block_ms=50,
        count=10,
        claim_min_idle_ms=100,
        claim_interval_s=0.0,
        max_deliveries=3,
    )
    await consumer.ensure_group()
    await producer.add(_traj("good-0"))
    bad_id, _ = await producer.add(b"\x0a\xff\xff\xff\xff garbage", task_id="t")
    await producer.add(_traj("good-1"))

    handled, events = [], []
    deadline = time.monotonic() + 15
    while not await redis.xlen(STREAM_DEAD):
        assert time.monotonic() < deadline, "malformed entry never reached shellrl:dead"
        if (
            len(handled) == 2 and "late" not in handled
        ):  # an entry behind the poison one, added later
            await producer.add(_traj("late"))
            handled.append("late")
        for entry in await consumer.read():
            try:
                traj = parse_trajectory(entry.pb)
            except ContractError as exc:
                events.append(("fail", entry.deliveries))
                await consumer.fail(entry, str(exc))
                continue
            handled.append(traj.trajectory_id)
            events.append(("ok", traj.trajectory_id))
            await consumer.ack(entry.entry_id)

    assert [x for x in handled if x != "late"][:2] == ["good-0", "good-1"]
    assert ("ok", "late") in events and events.index(("ok", "late")) < events.index(("fail", 3))
    assert [e for e in events if e[0] == "fail"] == [("fail", 1), ("fail", 2), ("fail", 3)]
    ((_, dead),) = await redis.xrange(STREAM_DEAD)
    assert dead[b"entry_id"].decode() == bad_id and dead[b"deliveries"] == b"3"
    assert dead[b"source_stream"].decode() == STREAM and dead[b"group"].decode() == GROUP
    reason = dead[b"reason"].decode()
    assert reason.startswith("failed 3 times; last error: not a shellrl.v1.Trajectory"), reason
    assert dead[b"pb"] == b"\x0a\xff\xff\xff\xff garbage" and dead[b"task_id"] == b"t"
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0
    assert await StreamProducer(redis, STREAM).backlog(GROUP) == 0


async def test_entry_whose_consumers_keep_crashing_is_dead_lettered_on_its_next_delivery(redis):
    await StreamProducer(redis, STREAM).add(_traj("crashy"))
    await StreamConsumer(redis, STREAM, GROUP, "c0", block_ms=50).ensure_group()
    for i in range(2):  # two consumers read it and "crash" (never ack)
        c = StreamConsumer(
            redis,
            STREAM,
            GROUP,
            f"c{i}",
            block_ms=50,
            claim_min_idle_ms=0,
            claim_interval_s=0.0,
            max_deliveries=2,
        )
        assert len(await c.read()) == 1
    survivor = StreamConsumer(
        redis,
        STREAM,
        GROUP,
        "c9",
        block_ms=50,
        claim_min_idle_ms=0,
        claim_interval_s=0.0,
        max_deliveries=2,
    )
    assert await survivor.read() == []
    ((_, dead),) = await redis.xrange(STREAM_DEAD)
    assert b"delivered 3 times without acknowledgement" in dead[b"reason"]
    assert b"consumer crashed or timed out" in dead[b"reason"]


# --- trimming -------------------------------------------------------------------------------


async def test_trimming_never_removes_an_entry_a_group_has_not_acknowledged(redis):
    producer = StreamProducer(redis, STREAM)
    a = StreamConsumer(redis, STREAM, "learner", "a", block_ms=50, count=300, claim_interval_s=3600)
    b = StreamConsumer(redis, STREAM, "audit", "b", block_ms=50, count=200, claim_interval_s=3600)
    await a.ensure_group()
    await b.ensure_group()
    ids = [
        eid
        for eid, _ in await producer.add_many([OutgoingEntry(_traj(f"t{i}")) for i in range(400)])
    ]
    await a.ack(
        *(e.entry_id for e in await a.read() if e.entry_id != ids[150])
    )  # ids[150] pending in "learner"
    await b.ack(
        *(e.entry_id for e in await b.read())
    )  # "audit" acknowledged 0..199, never read 200..399

    removed = await producer.trim_acknowledged(maxlen=10)
    remaining = set(await _ids(redis))
    assert set(ids[150:]) <= remaining  # pending in one group, or undelivered in another: kept
    assert (
        removed == 400 - len(remaining) and removed >= 100
    )  # whole radix nodes below ids[150] went

    await b.ack(*(e.entry_id for e in await b.read(count=300)))
    await producer.trim_acknowledged(maxlen=10)
    assert set(ids[150:]) <= set(await _ids(redis))  # ids[150] is still pending in "learner"
    await a.ack(ids[150])
    await a.ack(*(e.entry_id for e in await a.read()))
    await producer.trim_acknowledged(maxlen=10)
    assert await redis.xlen(STREAM) <= 100  # approximate trim keeps at most a partial radix node


async def test_stream_without_groups_is_never_trimmed(redis):
    producer = StreamProducer(redis, STREAM)
    await producer.add_many([OutgoingEntry(_traj(f"t{i}")) for i in range(50)])
    assert await producer.trim_acknowledged(maxlen=0) == 0
    assert await redis.xlen(STREAM) == 50


async def test_producer_maxlen_bounds_acknowledged_history_but_keeps_unacknowledged_entries(redis):
    big = b"x" * 5000  # larger than a radix node: approximate trimming is exact per entry
    producer = StreamProducer(redis, STREAM, maxlen=100, trim_every=10)
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "l1", block_ms=50, count=50, claim_interval_s=3600
    )
    await consumer.ensure_group()
    for _ in range(20):  # 1,000 entries produced and consumed
        await producer.add_many([OutgoingEntry(big)] * 50)
        await consumer.ack(*(e.entry_id for e in await consumer.read()))
        assert await redis.xlen(STREAM) <= 100 + 50
    # the consumer stops; 300 more arrive: nothing unacknowledged may disappear
    added = [eid for eid, _ in await producer.add_many([OutgoingEntry(big)] * 300)]
    assert set(added) <= set(await _ids(redis))
    assert await producer.backlog(GROUP) == 300


# --- backpressure ---------------------------------------------------------------------------


async def test_backlog_counts_pending_and_undelivered_entries(redis):
    producer = StreamProducer(redis, STREAM)
    await producer.add_many([OutgoingEntry(_traj(f"t{i}")) for i in range(5)])
    assert await producer.backlog(GROUP) == 5  # no group yet: everything is backlog
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "l1", block_ms=50, count=3, claim_interval_s=3600
    )
    await consumer.ensure_group()
    entries = await consumer.read()
    assert await producer.backlog(GROUP) == 5  # 3 pending + 2 undelivered
    await consumer.ack(*(e.entry_id for e in entries))
    assert await producer.backlog(GROUP) == 2


async def test_wait_for_backlog_below_blocks_until_the_consumer_catches_up(redis):
    producer = StreamProducer(redis, STREAM)
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "l1", block_ms=50, count=10, claim_interval_s=3600
    )
    await consumer.ensure_group()
    await producer.add_many([OutgoingEntry(_traj(f"t{i}")) for i in range(5)])
    assert await producer.wait_for_backlog_below(GROUP, 6) < 0.1
    with pytest.raises(TimeoutError, match="stayed >= 5"):
        await producer.wait_for_backlog_below(GROUP, 5, poll_s=0.02, timeout_s=0.2)

    async def consume_later() -> None:
        await asyncio.sleep(0.3)
        entries = await consumer.read()
        await consumer.ack(*(e.entry_id for e in entries[:3]))

    task = asyncio.create_task(consume_later())
    waited = await producer.wait_for_backlog_below(GROUP, 3, poll_s=0.02, timeout_s=60)
    await task
    assert 0.25 <= waited < 60  # it waited for the consumer (>= its 0.3 s), then returned
    assert await producer.backlog(GROUP) == 2


# --- the blocking-read rule -----------------------------------------------------------------


async def test_block_ms_at_or_above_half_the_socket_timeout_is_refused(redis_server):
    client = connect(redis_server.url, socket_timeout=1.0)
    with pytest.raises(ValueError, match="below half the client's socket_timeout"):
        StreamConsumer(client, STREAM, GROUP, "c", block_ms=500)
    StreamConsumer(client, STREAM, GROUP, "c", block_ms=400)
    for bad in (0, -1, 5000):
        with pytest.raises(ValueError, match="block_ms must be in"):
            StreamConsumer(client, STREAM, GROUP, "c", block_ms=bad)
    consumer = StreamConsumer(client, STREAM, GROUP, "c", block_ms=200)
    with pytest.raises(ValueError, match="socket_timeout"):
        await consumer.read(block_ms=900)
    unbounded = aioredis.Redis.from_url(
        redis_server.url
    )  # no socket timeout: only MAX_BLOCK_MS applies
    StreamConsumer(unbounded, STREAM, GROUP, "c", block_ms=4000)
    await client.aclose()
    await unbounded.aclose()


async def test_blocking_read_returns_empty_after_block_ms_and_block_ms_zero_never_blocks(
    redis_server,
):
    # each read takes at most its 0.3 s block; a bug costs the consumer's 3 s block_ms or the 10 s
    # socket timeout, so the 2 s bounds hold on a busy machine and still catch it
    client = connect(redis_server.url, socket_timeout=10.0)
    consumer = StreamConsumer(client, STREAM, GROUP, "c", block_ms=3000, claim_interval_s=3600)
    await consumer.ensure_group()
    start = time.monotonic()
    assert await asyncio.wait_for(consumer.read(block_ms=300), 5) == []
    # one BLOCK of 300 ms, not the consumer's 3 s nor a re-sent one after the 10 s socket timeout
    assert 0.25 <= time.monotonic() - start < 2.0
    start = time.monotonic()
    # Redis' BLOCK 0 would hang forever (the wait_for ends it); the consumer's block_ms, 3 s
    assert await asyncio.wait_for(consumer.read(block_ms=0), 5) == []
    assert time.monotonic() - start < 2.0
    await client.aclose()


async def test_delete_idle_consumers_keeps_consumers_with_pending_entries(redis):
    await StreamProducer(redis, STREAM).add(_traj("a"))
    busy = StreamConsumer(redis, STREAM, GROUP, "busy", block_ms=50, claim_interval_s=3600)
    idle = StreamConsumer(redis, STREAM, GROUP, "idle", block_ms=50, claim_interval_s=3600)
    await busy.ensure_group()
    assert len(await busy.read()) == 1
    assert await idle.read() == []
    assert await idle.delete_idle_consumers(min_idle_ms=60_000) == []  # both active just now
    assert await idle.delete_idle_consumers(min_idle_ms=0) == ["idle"]
    names = [c["name"] for c in await redis.xinfo_consumers(STREAM, GROUP)]
    assert names == [b"busy"]


async def test_stats_set_the_stream_gauges(redis):
    from prometheus_client import REGISTRY

    producer = StreamProducer(redis, STREAM)
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "l1", block_ms=50, count=2, claim_interval_s=3600
    )
    await consumer.ensure_group()
    await producer.add_many([OutgoingEntry(_traj(f"t{i}")) for i in range(5)])
    await consumer.read()
    assert await consumer.stats() == {"length": 5, "pending": 2, "lag": 3}
    assert (
        REGISTRY.get_sample_value("shellrl_stream_pending", {"stream": STREAM, "group": GROUP}) == 2
    )
    assert REGISTRY.get_sample_value("shellrl_stream_length", {"stream": STREAM}) == 5


async def test_the_dead_letter_stream_keeps_the_newest_entries_only(redis):
    producer = StreamProducer(redis, STREAM)
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "c", block_ms=50, max_deliveries=1, dead_maxlen=2
    )
    await consumer.ensure_group()
    for i in range(4):
        await producer.add(_traj(f"t{i}"))
    entries = await consumer.read()
    for entry in entries:
        await consumer.dead_letter(entry, "test")
    kept = await redis.xrange(STREAM_DEAD)
    assert [fields[b"entry_id"].decode() for _, fields in kept] == [
        e.entry_id for e in entries[-2:]
    ]
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0
