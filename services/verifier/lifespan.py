"""What runs beside the verifier's HTTP API while it lives: `running(parts)` runs the stream
worker (when enabled) and the stream-stats export, and on exit drains the verifications in flight
within `shutdown_grace_s`, then closes Redis and the sandbox client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from services.verifier.checks import VERIFIER_VERSION
from services.verifier.parts import Parts, consumer_name
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import export_stream_stats

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running(parts: Parts) -> AsyncIterator[None]:
    """Run the worker for the body of the `async with`, then drain and close."""
    settings, worker = parts.settings, parts.worker
    stop = asyncio.Event()
    worker_task = stats_task = shard_stats = None
    if worker is not None and parts.redis is not None:
        worker_task = asyncio.create_task(worker.run(stop))
        watched = [(worker.consumer.stream, worker.consumer.group)]
        stats_task = asyncio.create_task(export_stream_stats(parts.redis, watched))
        if worker.shards is not None and len(worker.shards) > 1:
            shard_stats = asyncio.create_task(worker.shards.export_shard_stats(watched))
    log.info(
        "verifier started",
        extra={
            "config": settings.public_dict(),
            "verifier_version": VERIFIER_VERSION,
            "consumer": consumer_name(settings),
        },
    )
    try:
        yield
    finally:
        stop.set()
        if worker is not None and worker_task is not None:
            await worker.drain(settings.shutdown_grace_s)
            # the loop ends once its read in progress returns (block_ms) and starts nothing more
            await asyncio.wait([worker_task], timeout=settings.block_ms / 1000 + 1)
        await cancel_and_wait(worker_task, stats_task, shard_stats, timeout_s=10.0)
        if worker is not None:
            await worker.aclose()
        if parts.redis is not None:
            await parts.redis.aclose()
        await parts.sandbox.aclose()
        log.info("verifier stopped")
