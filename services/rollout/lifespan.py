"""What runs beside the gateway's HTTP API while it lives: `running(parts)` starts the background
tasks over the parts (policy-version watcher, engine directory, training runs, task stats, replica
heartbeat, and with the worker enabled the pool feeder, stream stats and the rollout worker) and,
on exit, stops taking work, drains the episodes in flight within `shutdown_grace_s`, ends the
evaluations, and closes every client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from services.rollout.parts import Parts
from services.rollout.replicas import Replicas
from services.rollout.stats import TaskStats
from shellrl import streams
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import export_stream_stats

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running(parts: Parts) -> AsyncIterator[None]:
    """Run the gateway's background tasks for the body of the `async with`, then drain and close."""
    settings = parts.settings
    await parts.evaluations.mark_interrupted()
    stop = asyncio.Event()
    background = _background(parts, stop)
    main = None
    if settings.worker_enabled:
        main = asyncio.create_task(parts.worker.run(stop), name="rollout-worker")
        main.add_done_callback(_log_crash)
    log.info("rollout gateway started", extra={"config": settings.public_dict()})
    try:
        yield
    finally:
        stop.set()
        if main is not None:
            await cancel_and_wait(main)  # it may be waiting on the pool, capacity or admission
            await parts.worker.drain(settings.shutdown_grace_s)
        await parts.evaluations.shutdown()
        await cancel_and_wait(*background)
        await parts.shards.aclose()
        await parts.engine.close()
        await parts.sandbox.aclose()
        await parts.verifier.aclose()
        await parts.redis.aclose()


def _background(parts: Parts, stop: asyncio.Event) -> list[asyncio.Task]:
    """Start every background task but the rollout worker; each logs its crash."""
    settings = parts.settings
    tasks = [
        asyncio.create_task(parts.watcher.run(), name="policy-version-watcher"),
        asyncio.create_task(parts.directory.run(stop), name="engine-directory"),
        asyncio.create_task(parts.runs.watch(stop), name="training-runs"),
    ]
    consumers = [parts.pool.consumer]
    if settings.stats_enabled:
        stats = TaskStats(
            parts.redis,
            parts.store,
            parts.admission,
            consumer=settings.consumer_name,
            claim_min_idle_ms=settings.claim_min_idle_ms,
            steering=parts.steering,
            shards=parts.shards,
        )
        tasks.append(asyncio.create_task(stats.run(stop), name="task-stats"))
        consumers.append(stats.consumer)
    replicas = Replicas(
        parts.redis,
        parts.pool,
        parts.admission,
        consumers,
        name=settings.consumer_name,
        heartbeat_s=settings.heartbeat_s,
        dead_after_s=settings.replica_dead_after_s,
    )
    tasks.append(asyncio.create_task(replicas.run(stop), name="replica-heartbeat"))
    if settings.worker_enabled:
        tasks.append(asyncio.create_task(parts.pool.feed(stop), name="task-pool-feeder"))
        watched = [
            (streams.STREAM_TASKS, streams.GROUP_ROLLOUT),
            (streams.STREAM_EPISODES, streams.GROUP_VERIFIER),
        ]
        stream_stats = export_stream_stats(parts.redis, watched)
        tasks.append(asyncio.create_task(stream_stats, name="stream-stats"))
        if len(parts.shards) > 1:  # shellrl:episodes on the other stream shards (shards.py)
            shard_stats = parts.shards.export_shard_stats(
                [(streams.STREAM_EPISODES, streams.GROUP_VERIFIER)]
            )
            tasks.append(asyncio.create_task(shard_stats, name="stream-shard-stats"))
    for task in tasks:
        task.add_done_callback(_log_crash)
    return tasks


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(f"{task.get_name()} stopped", exc_info=task.exception())
