"""Per-task results from the scored stream: consumer group `rollout-stats` on shellrl:trajectories.

Why here and not in the verifier: the gateway owns the task hashes and `GET /v1/tasks/{id}`, and
reading the verifier's output stream with a group of its own needs nothing from the verifier or
the learner (their groups are independent; trimming waits for every group, ours included).

Each scored trajectory is counted once per task (`TaskStore.record_scored`, a Lua script with a
per-task set of counted ids), then acknowledged: a crash between the two re-delivers the entry and
the set makes the second count a no-op. Evaluation episodes never reach this stream; their
results live in the evaluation record.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from services.rollout import metrics as m
from services.rollout.task_store import TaskStore
from shellrl.contract import ContractError, Trajectory
from shellrl.streams import STREAM_TRAJECTORIES, StreamConsumer

log = logging.getLogger(__name__)

GROUP_STATS = "rollout-stats"


class TaskStats:
    def __init__(self, redis: aioredis.Redis, store: TaskStore, *, consumer: str, block_ms: int = 1000) -> None:
        self.store = store
        self.consumer = StreamConsumer(redis, STREAM_TRAJECTORIES, GROUP_STATS, consumer, block_ms=block_ms, count=128,
                                       claim_min_idle_ms=30_000)

    async def run(self) -> None:
        """Forever; survives Redis outages."""
        while True:
            try:
                await self.consumer.ensure_group("0")
                while True:
                    entries = await self.consumer.read()
                    for entry in entries:
                        await self.handle(entry)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("task stats consumer: %s", exc)
                await asyncio.sleep(1.0)

    async def handle(self, entry) -> None:
        traj = Trajectory()
        try:
            traj.ParseFromString(entry.pb)
            if not traj.trajectory_id or not traj.task_id:
                raise ContractError("trajectory_id or task_id is empty")
        except Exception as exc:
            await self.consumer.dead_letter(entry, f"not a valid shellrl.v1.Trajectory: {exc}")
            return
        counted = await self.store.record_scored(traj.task_id, traj.trajectory_id, traj.reward, scored=traj.scored)
        if counted == 1:
            m.STATS_RECORDED.inc()
        await self.consumer.ack(entry.entry_id)
