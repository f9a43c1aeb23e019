"""Heartbeats of the rollout replicas and the take-over of a dead replica's work.

Every replica writes its last-seen time (unix seconds) into `shellrl:rollout:replicas` every
`heartbeat_s`. A replica whose heartbeat is older than `dead_after_s` is dead (a replica that
comes back under another consumer name, as every restarted Kubernetes pod does, never returns
under the old one); any live replica then takes over its work on its next beat:

    tasks it took and never handed off   -> back to the head of the epoch order (TaskPool.recover)
    groups it had admitted, unfinished   -> admission given back (Admission.recover)
    its stream consumers                 -> deleted once they hold no pending entries (their
                                            pending entries are re-claimed by the live consumers'
                                            XAUTOCLAIM after `claim_min_idle_ms`)

Its name leaves the heartbeat set once none of its consumers is left. So a dead replica's tasks
and admission are back within `dead_after_s + heartbeat_s` of its last beat. Every step is
idempotent (atomic scripts), so several live replicas may take over the same one at once.
`dead_after_s` must exceed the longest pause of a live replica (a Redis outage, a stalled loop):
one declared dead while alive has its tasks run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.rollout.admission import Admission
from services.rollout.task_pool import TaskPool
from shellrl.streams import ShardedStreamConsumer, StreamConsumer
from shellrl.streams.keys import REPLICAS_KEY

log = logging.getLogger(__name__)


class Replicas:
    """This replica's heartbeat (`beat`) and the take-over of dead ones (`take_over_dead`)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        pool: TaskPool,
        admission: Admission,
        consumers: list[StreamConsumer | ShardedStreamConsumer],
        *,
        name: str,
        heartbeat_s: float = 5.0,
        dead_after_s: float = 60.0,
    ) -> None:
        if not 0 < heartbeat_s < dead_after_s:
            raise ValueError("0 < heartbeat_s < dead_after_s")
        self.redis, self.pool, self.admission, self.consumers = redis, pool, admission, consumers
        self.name, self.heartbeat_s, self.dead_after_s = name, heartbeat_s, dead_after_s

    async def run(self, stop: asyncio.Event) -> None:
        """Beat and take over dead replicas every `heartbeat_s` until `stop`; a Redis error is
        logged and the next beat tries again."""
        while not stop.is_set():
            try:
                await self.beat()
                await self.take_over_dead()
            except (RedisError, OSError) as exc:
                log.warning("replica heartbeat failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.heartbeat_s)

    async def beat(self) -> None:
        await self.redis.zadd(REPLICAS_KEY, {self.name: time.time()})

    async def take_over_dead(self) -> list[str]:
        """Take over every replica silent for `dead_after_s` (not this one). Returns their names."""
        raw = await self.redis.zrangebyscore(REPLICAS_KEY, "-inf", time.time() - self.dead_after_s)
        dead = [n.decode() for n in raw if n.decode() != self.name]
        for name in dead:
            tasks = await self.pool.recover(name)
            groups = await self.admission.recover(name)
            left = await self._delete_consumers(name)
            if not left:
                await self.redis.zrem(REPLICAS_KEY, name)
            log.warning(
                "took over a dead rollout replica",
                extra={"replica": name, "tasks": tasks, "groups": groups, "consumers_left": left},
            )
        return dead

    async def _delete_consumers(self, name: str) -> int:
        """Delete `name`'s consumers that hold no pending entries; returns how many are left."""
        idle_ms = int(self.dead_after_s * 1000)
        left = 0
        for consumer in self.consumers:
            parts = consumer.shards if isinstance(consumer, ShardedStreamConsumer) else [consumer]
            for part in parts:  # each stream shard's Redis (shellrl/streams/shards.py)
                await part.delete_idle_consumers(idle_ms)
                with contextlib.suppress(RedisError):  # no stream or group yet: no consumer
                    infos = await part.redis.xinfo_consumers(part.stream, part.group)
                    left += sum(1 for info in infos if _name(info) == name)
        return left


def _name(info: dict) -> str:
    value = info.get("name", info.get(b"name", b""))
    return value.decode() if isinstance(value, bytes) else str(value)
