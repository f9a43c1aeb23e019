"""Stream gauges for /metrics: shellrl_stream_length{stream}, shellrl_stream_pending{stream,group}
and shellrl_stream_lag{stream,group} of the streams a worker consumes or watches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shellrl.streams.consumer_groups import group_infos, undelivered
from shellrl.streams.metrics import STREAM_LAG, STREAM_LENGTH, STREAM_PENDING

log = logging.getLogger("shellrl.streams")

STATS_INTERVAL_S = 5.0


async def stream_stats(
    redis: aioredis.Redis, stream: str, group: str, shard: int = 0
) -> dict[str, int]:
    """{"length": XLEN, "pending": delivered, not acknowledged, "lag": not yet delivered} of
    `group` on `stream` (a group not created yet: pending 0, lag = length, as
    `StreamProducer.backlog` counts it). Sets shellrl_stream_length{stream},
    shellrl_stream_pending{stream,group} and shellrl_stream_lag{stream,group}; the label of
    stream shard k > 0 (shards.py) is "<stream>@<k>". Raises RedisError."""
    length = int(await redis.xlen(stream))
    pending, lag = 0, length
    for info in await group_infos(redis, stream):
        if info["name"] == group:
            pending = int(info["pending"])
            lag = info.get("lag")
            lag = (
                int(lag)
                if lag is not None
                else await undelivered(redis, stream, info["last-delivered-id"])
            )
    label = stream if shard == 0 else f"{stream}@{shard}"
    STREAM_LENGTH.labels(label).set(length)
    STREAM_PENDING.labels(label, group).set(pending)
    STREAM_LAG.labels(label, group).set(lag)
    return {"length": length, "pending": pending, "lag": lag}


async def export_stream_stats(
    redis: aioredis.Redis,
    groups: Sequence[tuple[str, str]],
    interval_s: float = STATS_INTERVAL_S,
    shard: int = 0,
) -> None:
    """Run forever (cancel the task to stop): `stream_stats` of every (stream, group) in `groups`
    at once, then every `interval_s` seconds (`shard`: the stream shard `redis` is, for the
    labels). A Redis error skips that round (logged; the gauges
    keep their last values) and never ends the task. Start it next to a worker's loop:

        stats = asyncio.create_task(export_stream_stats(redis, [(STREAM_EPISODES, GROUP_VERIFIER)]))
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    while True:
        for stream, group in groups:
            try:
                await stream_stats(redis, stream, group, shard)
            except (RedisError, OSError) as exc:
                log.debug(
                    "stream stats unavailable",
                    extra={"stream": stream, "group": group, "error": str(exc)},
                )
        await asyncio.sleep(interval_s)
