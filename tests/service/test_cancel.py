"""`cancel_and_wait` ends a stream consumer blocked in redis-py however the cancel lands.

On Python 3.11 redis-py's write path (`asyncio.wait_for`) can swallow a cancel (cpython gh-86296),
which hung `test_scheduler` for 600 s in CI; see shellrl/aio.py.
"""

from __future__ import annotations

import asyncio
import random

from shellrl.aio import cancel_and_wait
from shellrl.streams import connect


async def consume_forever(redis) -> None:
    while True:
        try:
            await redis.xreadgroup("g", "c", {"s": ">"}, count=10, block=1000)
            await redis.xadd("s", {"k": "v"}, maxlen=100)
        except asyncio.CancelledError:
            raise
        except Exception:  # a feeder's survive-Redis-outages loop, as in services/rollout/scheduler.py
            await asyncio.sleep(0.1)


async def test_every_cancelled_consumer_finishes_however_the_cancel_lands(redis_server):
    redis = connect(redis_server.url)
    await redis.xgroup_create("s", "g", id="0", mkstream=True)
    rng = random.Random(0)
    try:
        for _ in range(200):
            task = asyncio.create_task(consume_forever(redis))
            await asyncio.sleep(rng.random() * 0.02)
            assert await cancel_and_wait(task, timeout_s=3.0)
            assert task.cancelled()
    finally:
        await redis.aclose()


async def test_a_task_that_never_ends_is_reported_after_the_timeout():
    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # swallows every cancel

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await cancel_and_wait(task, timeout_s=0.3) is False
    task.get_coro().close()  # let the test end


async def test_none_and_finished_tasks_are_skipped_and_exceptions_are_not_raised():
    async def fails():
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    assert await cancel_and_wait(None, task) is True
    assert isinstance(task.exception(), ValueError)
