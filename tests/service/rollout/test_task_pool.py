"""The training pool on a real Redis: shuffled epochs, mid-epoch arrivals, restarts, eval tasks kept out."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from shellrl.contract import task_from_json
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import STREAM_DEAD, STREAM_TASKS, connect


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def task(i: int, split: str = "train"):
    return task_from_json(
        {
            "task_id": f"t{i}",
            "instruction": f"task {i}",
            "split": split,
            "check": {"type": "answer_equals", "expected": "x"},
        }
    )


async def feed_until(pool: TaskPool, size: int) -> asyncio.Task:
    feeder = asyncio.create_task(pool.feed())
    for _ in range(200):
        if await pool.size() >= size:
            return feeder
        await asyncio.sleep(0.02)
    raise AssertionError("pool did not fill")


async def test_every_epoch_is_a_seeded_permutation_of_the_pool_and_eval_tasks_never_join(redis):
    store = TaskStore(redis)
    for i in range(5):
        await store.submit(task(i))
    await store.submit(task(99, split="eval_id"))
    await redis.xadd(STREAM_TASKS, {"pb": b"\xff garbage", "task_id": "bad"})
    pool = TaskPool(redis, store, consumer="rollout-0", seed=7)
    feeder = await feed_until(pool, 5)
    order = [(await pool.next_task()).task.task_id for _ in range(10)]
    assert sorted(order[:5]) == sorted(order[5:]) == [f"t{i}" for i in range(5)]
    assert order[:5] != order[5:] or order[:5] != sorted(
        order[:5]
    )  # shuffled, not submission order twice
    assert await pool.epoch() == 1 and "t99" not in order  # epoch 0: arrivals at random positions
    assert (await store.describe("t0"))["state"] == "pooled" and (await store.describe("t99"))[
        "state"
    ] == "held_out"
    dead = await redis.xrange(STREAM_DEAD)
    assert len(dead) == 1 and b"not a valid shellrl.v1.Task" in dead[0][1][b"reason"]
    await cancel_and_wait(feeder)


async def test_a_task_submitted_mid_epoch_runs_once_in_it_and_a_restart_continues_the_epoch(redis):
    store = TaskStore(redis)
    for i in range(4):
        await store.submit(task(i))
    pool = TaskPool(redis, store, consumer="rollout-0", seed=1)
    feeder = await feed_until(pool, 4)
    first = [(await pool.next_task()).task.task_id for _ in range(2)]
    await store.submit(task(4))
    await feed_until(pool, 5)
    await cancel_and_wait(feeder)
    restarted = TaskPool(
        redis, store, consumer="rollout-0", seed=1
    )  # a new process: same Redis state
    rest = [(await restarted.next_task()).task.task_id for _ in range(3)]
    assert sorted(first + rest) == [
        f"t{i}" for i in range(5)
    ]  # t4 joined the running epoch exactly once
    assert await restarted.epoch() == 0
    nxt = await restarted.next_task()
    assert nxt.epoch == 1 and await restarted.epoch() == 1
