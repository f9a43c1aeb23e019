"""Per-task results from the scored stream: consumer group `rollout-stats` on shellrl:trajectories.

Why here and not in the verifier: the gateway owns the task hashes and `GET /v1/tasks/{id}`, and
reading the verifier's output stream with a group of its own needs nothing from the verifier or
the learner (their groups are independent; trimming waits for every group, ours included).

Each scored trajectory is counted once per task (`TaskStore.record_scored`, a Lua script with a
per-task set of counted ids), then acknowledged: a crash between the two re-delivers the entry and
the set makes the second count a no-op. Evaluation episodes never reach this stream; their
results live in the evaluation record.

The same pass keeps the gateway's admission accounting in step with the learner: a member the
verifier failed with FAILURE_INFRA_VERIFIER was usable when the gateway handed its group off, and
is not usable for the learner (`shellrl.contract.is_infra`); `Admission.member_lost` counts it
(idempotent by trajectory id) and gives the group's admission back when fewer than 2 usable
members remain. The verifier passes every upstream failure through unchanged, so INFRA_VERIFIER
is the only INFRA class on this stream that the gateway has not counted already. Every other
usable member goes to `Admission.member_scored` (dynamic sampling: a group whose usable members
all scored the same gives its admission back), and, counted for the first time, to pass-rate
steering's per-template outcomes (steering.py) when that is on.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services.rollout import metrics as m
from services.rollout.admission import Admission
from services.rollout.steering import Steering
from services.rollout.task_store import TaskStore
from shellrl.contract import ContractError, Failure, Trajectory, is_infra
from shellrl.streams import STREAM_TRAJECTORIES, StreamEntry, StreamShards

GROUP_STATS = "rollout-stats"


class TaskStats:
    def __init__(
        self,
        redis: aioredis.Redis,
        store: TaskStore,
        admission: Admission,
        *,
        consumer: str,
        block_ms: int = 1000,
        claim_min_idle_ms: int = 30_000,
        steering: Steering | None = None,
        shards: StreamShards | None = None,
    ) -> None:
        self.store, self.admission, self.steering = store, admission, steering
        # shellrl:trajectories on every stream shard (shards.py; None: only `redis`)
        self.consumer = (shards or StreamShards(redis)).consumer(
            STREAM_TRAJECTORIES,
            GROUP_STATS,
            consumer,
            block_ms=block_ms,
            count=128,
            claim_min_idle_ms=claim_min_idle_ms,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Take scored trajectories, count them, acknowledge; until `stop`. Redis outages are
        waited out by `StreamConsumer.take`."""
        await self.consumer.ensure_group("0")
        await self.consumer.consume(stop, self.handle, "task stats")

    async def handle(self, entry: StreamEntry) -> None:
        traj = Trajectory()
        try:
            traj.ParseFromString(entry.pb)
            if not traj.trajectory_id or not traj.task_id:
                raise ContractError("trajectory_id or task_id is empty")
        except Exception as exc:  # any decode failure: a poison entry goes to the dead letters
            await self.consumer.dead_letter(entry, f"not a valid shellrl.v1.Trajectory: {exc}")
            return
        counted = await self.store.record_scored(
            traj.task_id, traj.trajectory_id, traj.reward, scored=traj.scored
        )
        if counted == 1:
            m.STATS_RECORDED.inc()
        if traj.failure == Failure.FAILURE_INFRA_VERIFIER and traj.group_id and not traj.eval:
            await self.admission.member_lost(traj.group_id, traj.trajectory_id)
        elif traj.group_id and not traj.eval and not is_infra(traj.failure):
            await self.admission.member_scored(traj)
            if self.steering is not None and counted == 1 and traj.scored:
                await self.steering.record(traj.task, traj.reward >= 1.0)
        await self.consumer.ack(entry.entry_id)
