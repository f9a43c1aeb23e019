"""Training runs on a running stack: `POST /v1/runs` gives the pool a train set and so starts
admission; `GET /v1/runs/{id}` shows how far the learner got with it (run_routes.py).

A run is a train set (inline tasks, or a JSONL task file under the gateway's `task_file_dir`) and
how long to train on it: `steps` learner steps (policy versions past the version at its start)
and, optionally, `time_budget_s`. Starting one stores every task as `POST /v1/tasks` does (a new
task streams to the pool), puts a task already stored by an earlier run back into the pool (it is
streamed to shellrl:tasks again; the pool feeder joins it once) and records the run as the active
one. The rollout worker then admits groups of the pool's tasks under the staleness bound as always.

Guarantees:
* one run trains at a time (the stack has one learner): a start while another run is `training`
  or being started (by any replica: the start lock shellrl:runs:starting) is refused
  (`RunConflict`), before any of its tasks reaches the pool;
* a run ends once: `done` when the learner's policy version reaches `target_policy_version`,
  `time_up` past its time budget (both noticed by `watch` within `poll_s`, on any replica), or
  `stopped` (`stop`); its tasks then leave the pool and the epoch order (state `retired`), so
  nothing new is admitted for it; groups already in flight finish and reach the learner;
* progress counts only the run's own episodes: the task counters (task_store.py) minus their
  values when the run started.

Redis: shellrl:run:{id} (hash: `meta` JSON, `baseline` JSON, `state`, `created_at`,
`finished_at`), shellrl:run:{id}:tasks (list of task ids), shellrl:runs:index (zset by start
time), shellrl:runs:active (the training run's id), shellrl:runs:starting (the start lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from services.rollout.task_store import TaskConflict, TaskStore, task_digest
from shellrl.contract import Task
from shellrl.streams import POLICY_VERSION_KEY, STREAM_TASKS, task_key
from shellrl.streams.keys import (
    ACTIVE_RUN_KEY,
    ADMITTED_KEY,
    ORDER_KEY,
    POOL_KEY,
    RUN_INDEX_KEY,
    RUN_START_LOCK_KEY,
    run_key,
)

log = logging.getLogger(__name__)

TRAINING, DONE, TIME_UP, STOPPED = "training", "done", "time_up", "stopped"
STATE_RETIRED = "retired"  # task state of a finished run's tasks (out of the pool)
START_LOCK_TTL_S = 300  # a start never holds the lock longer (a crashed replica's lock expires)
COUNTERS = ("episodes_finished", "episodes_failed", "episodes_scored", "successes", "reward_sum")

# KEYS[1] run hash, KEYS[2] active run key; ARGV[1] final state, ARGV[2] now, ARGV[3] run id.
# Ends a training run exactly once (several replicas may notice it at once).
_END = """
if redis.call('HGET', KEYS[1], 'state') ~= 'training' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'finished_at', ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""

# KEYS[1] active run key, KEYS[2] the new run's hash, KEYS[3] index; ARGV[1] run id,
# ARGV[2] meta JSON, ARGV[3] baseline JSON, ARGV[4] now. Refuses while another run is active.
_BEGIN = """
local active = redis.call('GET', KEYS[1])
if active then return active end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'meta', ARGV[2], 'baseline', ARGV[3], 'state', 'training',
  'created_at', ARGV[4])
redis.call('ZADD', KEYS[3], tonumber(ARGV[4]), ARGV[1])
return ''
"""


class RunConflict(Exception):
    """Another run is training (its id in `run_id`); or a task id holds other content."""

    def __init__(self, message: str, field: str, run_id: str | None = None) -> None:
        super().__init__(message)
        self.field, self.run_id = field, run_id


@dataclass(frozen=True)
class RunPlan:
    """A train set and how long to train on it. steps: learner steps (>= 1); time_budget_s:
    seconds from the start (None: no limit); task_file: where the tasks came from (None: inline)."""

    tasks: list[Task]
    steps: int
    time_budget_s: float | None = None
    name: str | None = None
    task_file: str | None = None


class Runs:
    def __init__(self, redis: aioredis.Redis, store: TaskStore) -> None:
        self.redis, self.store = redis, store
        self._end = redis.register_script(_END)
        self._begin = redis.register_script(_BEGIN)

    async def start(self, plan: RunPlan) -> dict:
        """Store the train set, give the pool its tasks, record the run; returns its view.
        Raises RunConflict (another run training or being started: field `run`; a task id with
        other content: field `tasks[i].task_id`)."""
        run_id = f"run-{uuid.uuid4().hex[:12]}"
        # one start at a time on the stack (any replica): none pools tasks for a run that loses
        if not await self.redis.set(RUN_START_LOCK_KEY, run_id, nx=True, ex=START_LOCK_TTL_S):
            raise RunConflict("another run is being started; try again", "run")
        try:
            if active := await self._training_run():
                raise RunConflict(f"run {active} is training; stop it first", "run", active)
            await self._start(run_id, plan)
        finally:
            if await self.redis.get(RUN_START_LOCK_KEY) == run_id.encode():
                await self.redis.delete(RUN_START_LOCK_KEY)
        return await self.describe(run_id)

    async def _start(self, run_id: str, plan: RunPlan) -> None:
        await self._check_conflicts(plan.tasks)
        counts = {"created": 0, "duplicates": 0, "repooled": 0}
        ids: list[str] = []
        for i, task in enumerate(plan.tasks):
            try:
                result = await self.store.submit(task)
            except TaskConflict as exc:
                raise RunConflict(f"tasks[{i}].task_id: {exc}", f"tasks[{i}].task_id") from None
            ids.append(result.task_id)
            if result.status == "created":
                counts["created"] += 1
                continue
            counts["duplicates"] += 1
            if not await self.redis.sismember(POOL_KEY, result.task_id):
                await self.redis.xadd(
                    STREAM_TASKS, {"pb": task.SerializeToString(), "task_id": result.task_id}
                )
                counts["repooled"] += 1
        ids = list(dict.fromkeys(ids))
        version = await self._policy_version()
        meta = {
            "run_id": run_id,
            **{k: v for k, v in asdict(plan).items() if k != "tasks"},
            "tasks": len(ids),
            "submitted": counts,
            "start_policy_version": version,
            "target_policy_version": version + plan.steps,
            "start_groups_admitted": int(await self.redis.get(ADMITTED_KEY) or 0),
        }
        await self.redis.delete(run_key(run_id) + ":tasks")
        await self.redis.rpush(run_key(run_id) + ":tasks", *ids)
        baseline = await self._counters(ids)
        refused = await self._begin(
            keys=[ACTIVE_RUN_KEY, run_key(run_id), RUN_INDEX_KEY],
            args=[run_id, json.dumps(meta), json.dumps(baseline), f"{time.time():.3f}"],
        )
        if refused:  # a run recorded by hand meanwhile (every start holds the start lock)
            other = refused.decode() if isinstance(refused, bytes) else str(refused)
            await self.redis.delete(run_key(run_id) + ":tasks")
            raise RunConflict(f"run {other} is training; stop it first", "run", other)
        log.info(
            "training run started",
            extra={"run_id": run_id, "submitted": counts, "steps": plan.steps},
        )

    async def _check_conflicts(self, tasks: list[Task]) -> None:
        """Raise RunConflict (field `tasks[i].task_id`) when a task id is stored with other
        content, before any task is stored (POST /v1/tasks's 409, for the whole set at once)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for task in tasks:
                pipe.hget(task_key(task.task_id or "-"), "digest")
            stored = await pipe.execute()
        for i, (task, digest) in enumerate(zip(tasks, stored, strict=True)):
            if task.task_id and digest is not None and digest.decode() != task_digest(task):
                message = f"tasks[{i}].task_id: task {task.task_id} exists with different content"
                raise RunConflict(message, f"tasks[{i}].task_id")

    async def describe(self, run_id: str) -> dict | None:
        """The JSON view of `GET /v1/runs/{id}` (None when unknown): the plan, `state`,
        `policy_version`, `steps_done`, `progress` (steps_done / steps, 0..1), `elapsed_s`,
        `groups_admitted` since the start and `episodes` (finished, failed, scored, successes,
        success_rate, mean_reward over scored ones) of the run's tasks since the start."""
        raw = await self.redis.hgetall(run_key(run_id))
        if not raw:
            return None
        h = {k.decode(): v.decode() for k, v in raw.items()}
        meta, baseline = json.loads(h["meta"]), json.loads(h["baseline"])
        ids = [i.decode() for i in await self.redis.lrange(run_key(run_id) + ":tasks", 0, -1)]
        now_counts = await self._counters(ids)
        d = {k: now_counts[k] - baseline.get(k, 0) for k in COUNTERS}
        version = await self._policy_version()
        steps_done = max(0, min(version - meta["start_policy_version"], meta["steps"]))
        created_at = float(h["created_at"])
        finished_at = float(h["finished_at"]) if "finished_at" in h else None
        scored = int(d["episodes_scored"])
        return {
            **meta,
            "state": h["state"],
            "created_at": created_at,
            "finished_at": finished_at,
            "elapsed_s": round((finished_at or time.time()) - created_at, 3),
            "policy_version": version,
            "steps_done": steps_done,
            "progress": steps_done / meta["steps"],
            "groups_admitted": int(await self.redis.get(ADMITTED_KEY) or 0)
            - meta["start_groups_admitted"],
            "episodes": {
                "finished": int(d["episodes_finished"]),
                "failed": int(d["episodes_failed"]),
                "scored": scored,
                "successes": int(d["successes"]),
                "success_rate": d["successes"] / scored if scored else None,
                "mean_reward": d["reward_sum"] / scored if scored else None,
            },
        }

    async def recent(self, limit: int = 20) -> list[dict]:
        ids = [r.decode() for r in await self.redis.zrevrange(RUN_INDEX_KEY, 0, limit - 1)]
        return [v for v in [await self.describe(i) for i in ids] if v is not None]

    async def stop(self, run_id: str) -> dict | None:
        """End a training run now (`stopped`); a run already ended stays as it is. Returns its
        view (None when unknown)."""
        if not await self.redis.exists(run_key(run_id)):
            return None
        await self._finish(run_id, STOPPED)
        return await self.describe(run_id)

    async def watch(self, stop: asyncio.Event, poll_s: float = 2.0) -> None:
        """Until `stop`: end the active run once it reached its steps (`done`) or its time
        budget (`time_up`). Redis errors are logged and retried at the next poll."""
        while not stop.is_set():
            try:
                await self.check_active()
            except Exception:  # Redis away or a bad record: logged, checked again next poll
                log.exception("checking the active training run failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)

    async def check_active(self) -> str | None:
        """End the active run if it is finished; returns the state it ended in (None: none)."""
        run_id = await self._training_run()
        view = await self.describe(run_id) if run_id else None
        if view is None:
            return None
        budget = view.get("time_budget_s")
        if view["steps_done"] >= view["steps"]:
            return DONE if await self._finish(run_id, DONE) else None
        if budget is not None and view["elapsed_s"] >= budget:
            return TIME_UP if await self._finish(run_id, TIME_UP) else None
        return None

    async def _finish(self, run_id: str, state: str) -> bool:
        ended = await self._end(
            keys=[run_key(run_id), ACTIVE_RUN_KEY], args=[state, f"{time.time():.3f}", run_id]
        )
        if not ended:  # ended before: its tasks may be another run's by now
            return False
        ids = [i.decode() for i in await self.redis.lrange(run_key(run_id) + ":tasks", 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.srem(POOL_KEY, task_id)
                pipe.lrem(ORDER_KEY, 0, task_id)
                pipe.hset(task_key(task_id), "state", STATE_RETIRED)
            await pipe.execute()
        log.info("training run ended", extra={"run_id": run_id, "state": state})
        return True

    async def _training_run(self) -> str | None:
        raw = await self.redis.get(ACTIVE_RUN_KEY)
        return raw.decode() if raw else None

    async def _policy_version(self) -> int:
        raw = await self.redis.get(POLICY_VERSION_KEY)
        return int(raw) if raw is not None else 0

    async def _counters(self, ids: list[str]) -> dict[str, float]:
        """Sum of the task counters (COUNTERS) over `ids`."""
        totals = dict.fromkeys(COUNTERS, 0.0)
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.hmget(task_key(task_id), *COUNTERS)
            rows = await pipe.execute()
        for row in rows:
            for name, value in zip(COUNTERS, row, strict=True):
                totals[name] += float(value) if value is not None else 0.0
        return totals
