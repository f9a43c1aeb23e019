"""What runs beside the learner's HTTP API while it lives: `running(parts)` runs the training
loop (the worker) and the stream-stats export, and on exit drains the step in progress within
`shutdown_grace_s`, then closes the weight sync (the engines destroy their weight-update groups
too), the engine client and Redis. A worker that died of an error takes the process down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator

from services.learner import metrics
from services.learner.group_assembler import DROP_REASONS
from services.learner.parts import Parts
from shellrl import streams
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import export_stream_stats

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running(parts: Parts) -> AsyncIterator[None]:
    """Run the worker for the body of the `async with` (parts.worker_task), then drain and close."""
    metrics.init_series(DROP_REASONS)
    settings, worker = parts.settings, parts.worker
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    task.add_done_callback(_exit_on_error)
    parts.worker_task = task
    watched = [(streams.STREAM_TRAJECTORIES, streams.GROUP_LEARNER)]
    stats = asyncio.create_task(export_stream_stats(parts.redis, watched))
    shard_stats = None
    if worker.shards is not None and len(worker.shards) > 1:
        shard_stats = asyncio.create_task(worker.shards.export_shard_stats(watched))
    log.info(
        "learner started",
        extra={"config": settings.public_dict(), "transport": worker.sync.transport},
    )
    try:
        yield
    finally:
        stop.set()
        await worker.drain(settings.shutdown_grace_s)
        await cancel_and_wait(task, stats, shard_stats, timeout_s=10.0)
        await worker.close_streams()
        await worker.sync.aclose()  # the engines destroy their weight-update groups too
        await parts.client.close()
        await parts.redis.aclose()


def _exit_on_error(task: asyncio.Task) -> None:
    """A worker that died of an error takes the process down (SIGTERM to itself), so the
    supervisor restarts it from the last checkpoint instead of serving a learner that never trains."""
    if not task.cancelled() and task.exception() is not None:
        log.error("learner worker stopped with an error; exiting", exc_info=task.exception())
        os.kill(os.getpid(), signal.SIGTERM)
