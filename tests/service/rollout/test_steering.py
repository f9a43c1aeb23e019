"""Pass-rate steering on a real Redis: per-template outcomes from the scored stream (the gateway's
stats consumer), and the task pool passing over templates solved always or never."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from services.rollout.admission import Admission
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.stats import GROUP_STATS, TaskStats
from services.rollout.steering import Steering, SteeringConfig, draw, template_key
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from shellrl.contract import task_from_json
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import STREAM_TRAJECTORIES, StreamProducer, connect
from tests.helpers.trajectories import make_trajectory
from tests.helpers.waiting import wait_until_async


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def task(task_id: str, template: str = ""):
    return task_from_json(
        {
            "task_id": task_id,
            "instruction": f"do {task_id}",
            "check": {"type": "answer_equals", "expected": "x"},
            "template": template,
        }
    )


async def pool_of(redis, tasks, steering: Steering) -> tuple[TaskPool, asyncio.Task]:
    store = TaskStore(redis)
    for t in tasks:
        await store.submit(t)
    pool = TaskPool(redis, store, consumer="rollout-0", seed=3, steering=steering)
    feeder = asyncio.create_task(pool.feed())
    await wait_until_async(lambda: _size_is(pool, len(tasks)), timeout_s=20, what="the pool")
    return pool, feeder


async def record(steering: Steering, template: str, outcomes: str) -> None:
    for o in outcomes:
        await steering.record(task(f"any-{template}", template), o == "1")


async def test_pass_rate_is_unknown_until_the_window_fills_then_follows_the_latest(redis):
    steering = Steering(redis, SteeringConfig(window_episodes=4))
    t = task("t", "count_lines")
    await record(steering, "count_lines", "111")
    assert await steering.pass_rate(t) is None and await steering.keep(t, epoch=1)
    await record(steering, "count_lines", "1")
    assert await steering.pass_rate(t) == 1.0
    await record(steering, "count_lines", "0000")  # the window slides past the successes
    assert await steering.pass_rate(t) == 0.0
    assert await steering.pass_rate(task("seed-1")) is None  # no template: kept per task
    assert template_key(task("seed-1")) == "task:seed-1"


async def test_pool_runs_the_band_and_unknown_templates_and_passes_over_the_rest(redis):
    steering = Steering(redis, SteeringConfig(window_episodes=4, keep_fraction=0.0))
    await record(steering, "never", "0000")
    await record(steering, "always", "1111")
    await record(steering, "learning", "0110")
    tasks = [
        task(f"{name}-{i}", name) for name in ("never", "always", "learning") for i in range(3)
    ]
    tasks += [task("fresh-0", "fresh")]
    pool, feeder = await pool_of(redis, tasks, steering)
    runs = Counter()
    for _ in range(4 * 4):  # four epochs of the four tasks steering keeps
        runs[(await pool.next_task()).task.template] += 1
    assert runs == {"learning": 12, "fresh": 4}
    await cancel_and_wait(feeder)


async def test_a_pool_that_is_all_out_of_band_still_runs_one_task_per_pool_worth(redis):
    steering = Steering(redis, SteeringConfig(window_episodes=2, keep_fraction=0.0))
    await record(steering, "never", "00")
    pool, feeder = await pool_of(redis, [task(f"never-{i}", "never") for i in range(5)], steering)
    first = await asyncio.wait_for(pool.next_task(), 20)
    second = await asyncio.wait_for(pool.next_task(), 20)
    assert first.task.template == second.task.template == "never"
    await cancel_and_wait(feeder)


def test_draws_keep_about_keep_fraction_and_depend_on_seed_task_and_epoch():
    draws = [draw(0, f"t{i}", 1) for i in range(2000)]
    assert 0.22 < sum(d < 0.25 for d in draws) / len(draws) < 0.28
    assert draw(0, "t1", 1) == draw(0, "t1", 1) != draw(1, "t1", 1) != draw(0, "t1", 2)


async def test_the_stats_consumer_records_each_training_outcome_once_per_template(redis):
    store = TaskStore(redis)
    steering = Steering(redis, SteeringConfig(window_episodes=8))
    lines = task("lines-1", "count_lines")
    await store.submit(lines)
    trajectories = []
    for i, reward in enumerate([1.0, 0.0, 1.0]):
        t = make_trajectory("g-1", reward, trajectory_id=f"g-1-{i}-a0", group_size=3)
        t.task_id = lines.task_id
        t.task.CopyFrom(lines)
        trajectories.append(t)
    producer = StreamProducer(redis, STREAM_TRAJECTORIES)
    for t in trajectories + trajectories[:1]:  # the first one delivered twice
        await producer.add(t.SerializeToString(), group_id=t.group_id)
    admission = Admission(
        redis, PolicyVersionWatcher(redis), replica="r", max_staleness=1, groups_per_step=1
    )
    stats = TaskStats(redis, store, admission, consumer="r", block_ms=100, steering=steering)
    stop = asyncio.Event()
    runner = asyncio.create_task(stats.run(stop))
    await wait_until_async(
        lambda: _is_zero(producer.backlog(GROUP_STATS)), timeout_s=20, what="stats"
    )
    stop.set()
    await cancel_and_wait(runner)
    outcomes = await redis.lrange("shellrl:rollout:template:count_lines:outcomes", 0, -1)
    assert outcomes == [b"1", b"0", b"1"]


async def _size_is(pool: TaskPool, n: int) -> bool:
    return await pool.size() >= n


async def _is_zero(awaitable) -> bool:
    return await awaitable == 0
