"""The gateway's bookkeeping survives a Redis restart at a group's hand-off (found by
tests/e2e/test_chaos.py): the group leaves flight, its admission is settled and its task leaves
the replica's taken list once Redis is back. Before, the failed `finish` left the group in flight
for good, and strict admission (bounded by the oldest group in flight) never admitted again."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.admission import Admission
from services.rollout.gates import Capacity, InfraGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.task_pool import TaskPool
from services.rollout.worker import RolloutConfig, RolloutWorker
from shellrl.contract import task_from_json
from shellrl.streams import POLICY_VERSION_KEY, STREAM_EPISODES, connect
from shellrl.streams.keys import (
    ADMITTED_KEY,
    INFLIGHT_KEY,
    ORDER_KEY,
    POOL_KEY,
    group_accounting_key,
    taken_key,
)
from tests.fakes.redis_outage import RedisOutageStore
from tests.fakes.scripted_agent import ScriptedAgent

TASK = task_from_json(
    {
        "task_id": "t-five",
        "instruction": "Say 5.",
        "check": {"type": "answer_integer_equals", "expected": 5},
    }
)


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


async def _up() -> bool:
    return True


async def test_a_group_handed_off_while_redis_restarts_leaves_flight_and_the_taken_list(
    redis, redis_server
):
    size = 2
    store = RedisOutageStore(redis, redis_server, outage_s=1.5)
    pool = TaskPool(redis, store, consumer="rollout-0")
    admission = Admission(
        redis,
        PolicyVersionWatcher(redis, poll_s=0.05),
        replica="rollout-0",
        max_staleness=0,
        groups_per_step=1,
        poll_s=0.05,
    )
    capacity = Capacity(size)
    worker = RolloutWorker(
        redis,
        store,
        pool,
        admission,
        ScriptedAgent("5"),
        capacity,
        InfraGate({"engine": _up, "sandbox": _up}, poll_s=0.05),
        RolloutConfig(group_size=size, max_attempts=1, retry_backoff_s=0.0),
    )
    await store.submit(TASK)
    await redis.rpush(ORDER_KEY, TASK.task_id)
    await redis.sadd(POOL_KEY, TASK.task_id)
    pooled = await pool.next_task()
    await capacity.acquire(size)
    ticket = await admission.admit("g-outage")
    await asyncio.wait_for(worker._run_taken(pooled.task, ticket, pooled.epoch), timeout=60)
    assert await asyncio.to_thread(store.restarted.wait, 30), "Redis is back"
    assert await redis.zcard(INFLIGHT_KEY) == 0, "the group left flight"
    assert await redis.hget(group_accounting_key("g-outage"), "usable") == b"2"
    assert int(await redis.get(ADMITTED_KEY)) == 1, "admitted once, not given back"
    assert await redis.llen(taken_key("rollout-0")) == 0, "the task left the taken list"
    assert await redis.xlen(STREAM_EPISODES) == size
    await redis.set(POLICY_VERSION_KEY, 1)  # the learner trained it: the next group fits
    assert await admission.try_admit("g-next") is not None
