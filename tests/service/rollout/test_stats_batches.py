"""The gateway's stats consumer handles a read's scored trajectories as one batch (stats.py
`handle_batch`): their scripts go to the control Redis in one pipelined round trip, and a bad
entry costs only itself. On a real Redis, plain and with two stream shards."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

import services.rollout.stats as stats_module
import shellrl.streams.consumer as consumer_module
from services.rollout.admission import Admission
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.stats import GROUP_STATS, TaskStats
from services.rollout.task_store import TaskStore
from shellrl.contract import Task, task_from_json
from shellrl.streams import (
    STREAM_DEAD,
    STREAM_TRAJECTORIES,
    ShardedStreamConsumer,
    StreamProducer,
    StreamShards,
    connect,
)
from shellrl.streams.keys import group_accounting_key
from tests.helpers.redis_server import RedisServer
from tests.helpers.trajectories import make_trajectory

TASK = task_from_json(
    {
        "task_id": "t-five",
        "instruction": "Say 5.",
        "check": {"type": "answer_integer_equals", "expected": 5},
    }
)
BROKEN = Task()
BROKEN.CopyFrom(TASK)
BROKEN.task_id = "t-broken"


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def shard_servers(tmp_path):
    servers = [RedisServer(tmp_path / f"shard-{k}").start() for k in (1, 2)]
    yield servers
    for server in servers:
        server.stop()


def _members(group: str, rewards: list[float], task_id: str = TASK.task_id):
    out = []
    for i, reward in enumerate(rewards):
        t = make_trajectory(group, reward, trajectory_id=f"{group}-{i}-a0", group_size=len(rewards))
        t.task_id = task_id
        out.append(t)
    return out


async def _take_all(stats: TaskStats, expected: int) -> list:
    """Every entry on the stream(s), as the consumer hands them out (tagged when sharded)."""
    stop, entries = asyncio.Event(), []
    async with asyncio.timeout(20):
        while len(entries) < expected:
            entries += await stats.consumer.take(stop)
    return entries


async def _check_one_batch(redis, shards: StreamShards) -> None:
    store = TaskStore(redis)
    await store.submit(TASK)
    await store.submit(BROKEN)
    await redis.set(f"shellrl:task:{BROKEN.task_id}:scored", "not a set")  # its script raises
    admission = Admission(
        redis, PolicyVersionWatcher(redis), replica="r", max_staleness=1, groups_per_step=1
    )
    stats = TaskStats(redis, store, admission, consumer="r", block_ms=100, shards=shards)
    await stats.consumer.ensure_group("0")
    good = _members("g-a", [1.0, 0.0, 1.0]) + _members("g-b", [0.0, 0.0])
    bad = _members("g-c", [1.0], task_id=BROKEN.task_id)
    producer = shards.producer(STREAM_TRAJECTORIES)
    for t in good + bad:
        await producer.add(t.SerializeToString(), group_id=t.group_id)
    poison = StreamProducer(shards.for_group("g-a"), STREAM_TRAJECTORIES)
    await poison.add(b"\xff not a trajectory", group_id="g-a")
    try:
        entries = await _take_all(stats, len(good) + len(bad) + 1)
    finally:
        if isinstance(stats.consumer, ShardedStreamConsumer):
            await stats.consumer.close()  # the takes still in flight on a shard

    await stats.handle_batch(entries)

    view = await store.describe(TASK.task_id)
    assert view["episodes"]["scored"] == 5 and view["rewards"]["successes"] == 2
    assert await redis.hget(group_accounting_key("g-a"), "arrived") == b"3"
    assert await redis.hget(group_accounting_key("g-b"), "arrived") == b"2"
    pending = {
        k: await c.xpending(STREAM_TRAJECTORIES, GROUP_STATS) for k, c in enumerate(shards.clients)
    }
    assert sum(p["pending"] for p in pending.values()) == 1  # the broken task's entry, failed
    assert (await store.describe(BROKEN.task_id))["episodes"]["scored"] == 0
    dead = [f for c in shards.clients for _, f in await c.xrange(STREAM_DEAD)]
    assert len(dead) == 1 and b"not a valid shellrl.v1.Trajectory" in dead[0][b"reason"]

    await stats.handle_batch(entries)  # delivered again (a crash before the acks): counted once
    assert (await store.describe(TASK.task_id))["episodes"]["scored"] == 5


async def test_a_batch_counts_every_good_entry_once_and_a_bad_one_costs_only_itself(redis):
    shards = StreamShards(redis)
    await _check_one_batch(redis, shards)


async def test_the_same_with_two_stream_shards(redis, shard_servers):
    shards = StreamShards(redis, [s.url for s in shard_servers])
    try:
        await _check_one_batch(redis, shards)
    finally:
        await shards.aclose()


class FailOnceRunScripts:
    """A fault: the first `run_scripts` raises a connection error after the real one ran (its
    reply lost, as in a Redis restart); every later call is the real one."""

    def __init__(self, real) -> None:
        self.real, self.failed = real, False

    async def __call__(self, redis, calls):
        replies = await self.real(redis, calls)
        if not self.failed:
            self.failed = True
            raise RedisConnectionError("injected: the reply was lost")
        return replies


async def test_a_batch_rerun_after_redis_went_away_dead_letters_a_poison_entry_once(
    redis, monkeypatch
):
    store = TaskStore(redis)
    await store.submit(TASK)
    admission = Admission(
        redis, PolicyVersionWatcher(redis), replica="r", max_staleness=1, groups_per_step=1
    )
    stats = TaskStats(redis, store, admission, consumer="r", block_ms=100)
    await stats.consumer.ensure_group("0")
    producer = StreamProducer(redis, STREAM_TRAJECTORIES)
    for t in _members("g-a", [1.0, 0.0]):
        await producer.add(t.SerializeToString(), group_id=t.group_id)
    await producer.add(b"\xff not a trajectory", group_id="g-a")
    entries = await _take_all(stats, 3)
    fault = FailOnceRunScripts(stats_module.run_scripts)
    monkeypatch.setattr(stats_module, "run_scripts", fault)
    stop = asyncio.Event()
    # what consume_batches does with a batch: re-run it while Redis is away
    await consumer_module._while_redis_away(lambda: stats.handle_batch(entries), "test", stop)
    assert fault.failed
    assert len(await redis.xrange(STREAM_DEAD)) == 1  # not once a run
    assert (await store.describe(TASK.task_id))["episodes"]["scored"] == 2  # counted once
    assert (await redis.xpending(STREAM_TRAJECTORIES, GROUP_STATS))["pending"] == 0
