"""Per-task results from the scored stream: consumer group `rollout-stats` on shellrl:trajectories.

Why here and not in the verifier: the gateway owns the task hashes and `GET /v1/tasks/{id}`, and
reading the verifier's output stream with a group of its own needs nothing from the verifier or
the learner (their groups are independent; trimming waits for every group, ours included).

Each scored trajectory is counted once per task (`TaskStore.record_scored`, a Lua script with a
per-task set of counted ids), then acknowledged: a crash between the two re-delivers the entry and
the set makes the second count a no-op. Evaluation episodes never reach this stream; their
results live in the evaluation record. A read's entries are handled together (`handle_batch`):
their scripts go to the control Redis as one pipelined round trip (shellrl/streams/script_batch.py),
so that the scored stream costs the control Redis one request a read, not two an episode
(BENCHMARKS.md, "The first Redis's per-episode accounting").

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
from shellrl.streams.script_batch import ScriptCall, run_scripts

GROUP_STATS = "rollout-stats"
# At most one read of the scored stream this often (s): the trajectories scored meanwhile come as
# one batch, one round trip to the control Redis. Statistics and dynamic sampling's give-backs
# wait that much longer at most; a learner step takes seconds.
BATCH_INTERVAL_S = 0.05


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
        batch_interval_s: float = BATCH_INTERVAL_S,
    ) -> None:
        self.redis, self.store, self.admission = redis, store, admission
        self.steering, self.batch_interval_s = steering, batch_interval_s
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
        waited out by `StreamConsumer.take` and `consume_batches`."""
        await self.consumer.ensure_group("0")
        await self.consumer.consume_batches(
            stop, self.handle_batch, "task stats", min_interval_s=self.batch_interval_s
        )

    async def handle_batch(self, entries: list[StreamEntry]) -> None:
        """Count a read's scored trajectories and acknowledge them. Every entry's scripts (task
        statistics, and group accounting for a training member) go to the control Redis in one
        pipelined round trip (`shellrl.streams.script_batch`), steering's outcomes in a second
        when it is on, the acknowledgements in one a stream shard. A poison entry goes to the
        dead letters; an entry whose script answered an error is failed alone (retried, then
        dead-lettered), and its neighbours are acknowledged."""
        work: list[tuple[StreamEntry, Trajectory, ScriptCall | None]] = []
        poison: list[tuple[StreamEntry, str]] = []
        for entry in entries:
            traj = Trajectory()
            try:
                traj.ParseFromString(entry.pb)
                if not traj.trajectory_id or not traj.task_id:
                    raise ContractError("trajectory_id or task_id is empty")
            except Exception as exc:  # any decode failure: a poison entry goes to the dead letters
                poison.append((entry, f"not a valid shellrl.v1.Trajectory: {exc}"))
                continue
            work.append((entry, traj, self._group_call(traj)))
        calls: list[ScriptCall] = []
        for _, traj, group_call in work:
            calls.append(
                self.store.record_scored_call(
                    traj.task_id, traj.trajectory_id, traj.reward, scored=traj.scored
                )
            )
            calls += [group_call] if group_call is not None else []
        replies = iter(await run_scripts(self.redis, calls))
        done, outcomes = [], []
        for entry, traj, group_call in work:
            counted = next(replies)
            group_reply = next(replies) if group_call is not None else 0
            error = next((r for r in (counted, group_reply) if isinstance(r, Exception)), None)
            if error is not None:
                await self.consumer.fail(entry, f"task stats: {error!r}")
                continue
            if counted == 1:
                m.STATS_RECORDED.inc()
            self.admission.gave_back(group_reply)
            member_scored = group_call is not None and not is_infra(traj.failure)
            if member_scored and self.steering is not None and counted == 1 and traj.scored:
                outcomes.append((traj.task, traj.reward >= 1.0))
            done.append(entry.entry_id)
        if outcomes:
            await self.steering.record_many(outcomes)
        if done:
            await self.consumer.ack(*done)
        # last: a Redis error before here re-runs the batch (consume_batches), and a poison entry
        # dead-lettered by the first run would be dead-lettered twice
        for entry, reason in poison:
            await self.consumer.dead_letter(entry, reason)

    def _group_call(self, traj: Trajectory) -> ScriptCall | None:
        """The group accounting a training member's outcome takes: a member the verifier failed
        with INFRA is lost (`Admission.member_lost`), any other usable one is scored
        (`Admission.member_scored`); evaluation episodes and the rollout's INFRA failures (already
        counted at hand-off) take none."""
        if not traj.group_id or traj.eval:
            return None
        if traj.failure == Failure.FAILURE_INFRA_VERIFIER:
            return self.admission.member_lost_call(traj.group_id, traj.trajectory_id)
        if is_infra(traj.failure):
            return None
        return self.admission.member_scored_call(traj)
