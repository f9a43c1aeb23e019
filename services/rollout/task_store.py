"""Tasks in Redis: submission, lookup, listing, and per-task episode statistics.

Layout (DESIGN.md section 3):
  shellrl:task:{id}              hash: pb (serialized Task), split, source, tags (JSON), digest,
                                 created_at, seq, state, and counters (below)
  shellrl:task:{id}:versions     hash: policy_version -> episodes finished with it (min ACTION version)
  shellrl:task:{id}:failures     hash: failure class -> episodes
  shellrl:task:{id}:scored       set of trajectory ids already counted (idempotent stats)
  shellrl:tasks:index            zset of task ids by submission sequence (pagination cursor)
  shellrl:tasks:index:{split}    zset per split (evaluations read the eval splits here)
  shellrl:tasks                  stream: training tasks, consumed by group `rollout` into the pool

Submission is one Lua script per task: a new task is stored, indexed and (split train) XADDed
atomically; the same content again is a no-op (`duplicate`); different content under an existing
task_id is a conflict. A task without task_id gets `task-<sha256 of its content>[:16]`, so that
re-submitting a file is idempotent.

Counters: episodes_started / episodes_finished / episodes_failed / episodes_in_flight are written by
the gateway (worker and agent loop); episodes_scored / reward_sum / successes / last_reward by
`record_scored` from the scored trajectories in shellrl:trajectories (stats.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shellrl.contract import Task, split_name, task_to_json
from shellrl.streams import STREAM_TASKS, task_key
from shellrl.streams.keys import TASK_INDEX_KEY, TASK_SEQ_KEY
from shellrl.streams.script_batch import GroupCommit, ScriptCall

STATE_QUEUED, STATE_POOLED, STATE_HELD_OUT = "queued", "pooled", "held_out"
EPISODE_COUNTERS_LINGER_S = 0.05  # an episode's counters wait this long (s) for others to batch
COUNTERS = (
    "episodes_started",
    "episodes_finished",
    "episodes_failed",
    "episodes_in_flight",
    "episodes_scored",
    "successes",
)


def index_key(split: str | None = None) -> str:
    return f"{TASK_INDEX_KEY}:{split}" if split else TASK_INDEX_KEY


def task_digest(task: Task) -> str:
    """sha256 hex of the task's content without its task_id (deterministic serialization)."""
    content = Task()
    content.CopyFrom(task)
    content.task_id = ""
    return hashlib.sha256(content.SerializeToString(deterministic=True)).hexdigest()


# KEYS[1] task hash, KEYS[2] index, KEYS[3] split index, KEYS[4] tasks stream, KEYS[5] seq
# ARGV[1] digest, ARGV[2] pb, ARGV[3] split, ARGV[4] source, ARGV[5] tags json, ARGV[6] now, ARGV[7] state,
# ARGV[8] task_id, ARGV[9] "1" to XADD
_SUBMIT = """
local existing = redis.call('HGET', KEYS[1], 'digest')
if existing then
  if existing == ARGV[1] then return {'duplicate', ''} end
  return {'conflict', existing}
end
local seq = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[1], 'pb', ARGV[2], 'digest', ARGV[1], 'split', ARGV[3], 'source', ARGV[4],
  'tags', ARGV[5], 'created_at', ARGV[6], 'seq', seq, 'state', ARGV[7],
  'episodes_started', 0, 'episodes_finished', 0, 'episodes_failed', 0, 'episodes_in_flight', 0,
  'episodes_scored', 0, 'successes', 0, 'reward_sum', 0)
redis.call('ZADD', KEYS[2], seq, ARGV[8])
redis.call('ZADD', KEYS[3], seq, ARGV[8])
local entry = ''
if ARGV[9] == '1' then entry = redis.call('XADD', KEYS[4], '*', 'pb', ARGV[2], 'task_id', ARGV[8]) end
return {'created', entry}
"""

# KEYS[1] task hash, KEYS[2] scored set; ARGV[1] trajectory id, ARGV[2] reward, ARGV[3] success 0/1,
# ARGV[4] now, ARGV[5] scored 0/1 (0: passed through unscored with a failure)
_SCORED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
if ARGV[5] == '1' then
  redis.call('HINCRBY', KEYS[1], 'episodes_scored', 1)
  redis.call('HINCRBYFLOAT', KEYS[1], 'reward_sum', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'successes', tonumber(ARGV[3]))
  redis.call('HSET', KEYS[1], 'last_reward', ARGV[2], 'last_scored_at', ARGV[4])
end
return 1
"""

# KEYS[1] task hash, KEYS[2] its failures hash, KEYS[3] its versions hash
# ARGV[1] failure label ('' none), ARGV[2] policy version ('' none), ARGV[3] final 0/1
_FINISHED = """
if ARGV[1] ~= '' then
  redis.call('HINCRBY', KEYS[1], 'episodes_failed', 1)
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
else
  redis.call('HINCRBY', KEYS[1], 'episodes_finished', 1)
end
if ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[2], 1) end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[1], 'episodes_in_flight', -1) end
return 1
"""

# KEYS[1] task hash; ARGV[1] episodes started, ARGV[2] in-flight change (default: ARGV[1])
_ADMITTED = """
redis.call('HINCRBY', KEYS[1], 'episodes_started', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'episodes_in_flight', ARGV[2] or ARGV[1])
return 1
"""


@dataclass(frozen=True)
class SubmitResult:
    task_id: str
    status: str  # created | duplicate
    split: str


class TaskConflict(Exception):
    def __init__(self, task_id: str) -> None:
        super().__init__(f"task {task_id} exists with different content")
        self.task_id = task_id


class TaskStore:
    def __init__(
        self, redis: aioredis.Redis, *, linger_s: float = EPISODE_COUNTERS_LINGER_S
    ) -> None:
        """linger_s: how long an episode's counters wait for others to share their round trip
        (`episode_finished`; seconds)."""
        self.redis = redis
        self._commits = GroupCommit(redis, linger_s)
        self._submit = redis.register_script(_SUBMIT)
        self._scored = redis.register_script(_SCORED)
        self._finished = redis.register_script(_FINISHED)
        self._admitted = redis.register_script(_ADMITTED)

    async def submit(self, task: Task) -> SubmitResult:
        """Store one validated task. Raises TaskConflict when its id holds different content."""
        digest = task_digest(task)
        if not task.task_id:
            task.task_id = f"task-{digest[:16]}"
        split = split_name(task.split)
        train = split == "train"
        status, _ = await self._submit(
            keys=[
                task_key(task.task_id),
                TASK_INDEX_KEY,
                index_key(split),
                STREAM_TASKS,
                TASK_SEQ_KEY,
            ],
            args=[
                digest,
                task.SerializeToString(),
                split,
                task.source,
                json.dumps(list(task.tags)),
                f"{time.time():.3f}",
                STATE_QUEUED if train else STATE_HELD_OUT,
                task.task_id,
                "1" if train else "0",
            ],
        )
        status = status.decode() if isinstance(status, bytes) else status
        if status == "conflict":
            raise TaskConflict(task.task_id)
        return SubmitResult(task.task_id, status, split)

    async def get_task(self, task_id: str) -> Task | None:
        raw = await self.redis.hget(task_key(task_id), "pb")
        if raw is None:
            return None
        task = Task()
        task.ParseFromString(raw)
        return task

    async def set_state(self, task_id: str, state: str) -> None:
        await self.redis.hset(task_key(task_id), "state", state)

    async def describe(self, task_id: str, *, with_task: bool = True) -> dict | None:
        """The JSON view of `GET /v1/tasks/{id}` (None when unknown)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(task_key(task_id))
            pipe.hgetall(task_key(task_id) + ":versions")
            pipe.hgetall(task_key(task_id) + ":failures")
            raw, versions, failures = await pipe.execute()
        if not raw:
            return None
        return _view(task_id, raw, versions, failures, with_task=with_task)

    async def list_tasks(
        self,
        *,
        split: str | None = None,
        source: str | None = None,
        tag: str | None = None,
        cursor: int = 0,
        limit: int = 50,
    ) -> tuple[list[dict], int | None]:
        """Tasks in submission order, filtered; returns (page, next_cursor or None).

        `cursor` is a submission sequence number: the page holds tasks with seq > cursor.
        """
        out: list[dict] = []
        start = f"({cursor}" if cursor else "-inf"
        key = index_key(split)
        while len(out) < limit:
            rows = await self.redis.zrangebyscore(
                key, start, "+inf", start=0, num=max(limit * 4, 64), withscores=True
            )
            if not rows:
                return out, None
            async with self.redis.pipeline(transaction=False) as pipe:
                for member, _ in rows:
                    pipe.hmget(task_key(_s(member)), "source", "tags")
                metas = await pipe.execute()
            for (member, seq), (src, tags) in zip(rows, metas):
                start = f"({int(seq)}"
                if source is not None and _s(src or b"") != source:
                    continue
                if tag is not None and tag not in json.loads(_s(tags or b"[]")):
                    continue
                item = await self.describe(_s(member), with_task=False)
                if item is not None:
                    out.append(item)
                if len(out) >= limit:
                    return out, int(seq)
        return out, None

    async def ids_of_split(self, split: str) -> list[str]:
        return [_s(m) for m in await self.redis.zrange(index_key(split), 0, -1)]

    async def count(self, split: str | None = None) -> int:
        return int(await self.redis.zcard(index_key(split)))

    # --- counters -------------------------------------------------------------------------

    async def episodes_admitted(self, task_id: str, n: int) -> None:
        """A group of `n` samples of `task_id` starts (by group commit, as `episode_finished`)."""
        await self._commits.call(ScriptCall(self._admitted, [task_key(task_id)], [n]))

    async def episode_finished(
        self, task_id: str, *, failure: str | None, policy_version: int | None, final: bool
    ) -> None:
        """One attempt ended. `final`: no retry follows (the sample leaves the in-flight count).
        Returns once the counters are written: by group commit, the episodes that end within
        `linger_s` of each other share one round trip to the control Redis (BENCHMARKS.md, "The
        first Redis's per-episode accounting")."""
        key = task_key(task_id)
        await self._commits.call(
            ScriptCall(
                self._finished,
                [key, key + ":failures", key + ":versions"],
                [
                    failure or "",
                    "" if policy_version is None else str(policy_version),
                    "1" if final else "0",
                ],
            )
        )

    async def episodes_abandoned(self, task_id: str, n: int) -> None:
        """Episodes admitted but never run to the end (shutdown): leave the in-flight count (by
        group commit: increments, so whichever batch lands first the count ends right)."""
        if n:
            await self._commits.call(ScriptCall(self._admitted, [task_key(task_id)], [0, -n]))

    async def record_scored(
        self, task_id: str, trajectory_id: str, reward: float, *, scored: bool
    ) -> int:
        """Count one scored trajectory once. Returns 1 counted, 0 already counted, -1 unknown task."""
        call = self.record_scored_call(task_id, trajectory_id, reward, scored=scored)
        return int(await call.script(keys=call.keys, args=call.args))

    def record_scored_call(
        self, task_id: str, trajectory_id: str, reward: float, *, scored: bool
    ) -> ScriptCall:
        """`record_scored` as a call to run in a batch (`shellrl.streams.script_batch`); its
        reply is the same int."""
        return ScriptCall(
            self._scored,
            [task_key(task_id), task_key(task_id) + ":scored"],
            [
                trajectory_id,
                repr(float(reward)),
                "1" if reward >= 1.0 else "0",
                f"{time.time():.3f}",
                "1" if scored else "0",
            ],
        )


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _view(task_id: str, raw: dict, versions: dict, failures: dict, *, with_task: bool) -> dict:
    h = {_s(k): v for k, v in raw.items()}
    num = lambda name: int(float(_s(h.get(name, b"0"))))
    scored = num("episodes_scored")
    reward_sum = float(_s(h.get("reward_sum", b"0")))
    out = {
        "task_id": task_id,
        "state": _s(h.get("state", b"")),
        "split": _s(h.get("split", b"")),
        "source": _s(h.get("source", b"")),
        "tags": json.loads(_s(h.get("tags", b"[]"))),
        "created_at": float(_s(h.get("created_at", b"0"))),
        "episodes": {
            "started": num("episodes_started"),
            "finished": num("episodes_finished"),
            "failed": num("episodes_failed"),
            "in_flight": num("episodes_in_flight"),
            "scored": scored,
        },
        "rewards": {
            "mean": reward_sum / scored if scored else None,
            "successes": num("successes"),
            "success_rate": num("successes") / scored if scored else None,
            "last": float(_s(h["last_reward"])) if "last_reward" in h else None,
        },
        "policy_versions": {
            _s(k): int(v) for k, v in sorted(versions.items(), key=lambda kv: int(kv[0]))
        },
        "failures": {_s(k): int(v) for k, v in failures.items()},
    }
    if with_task and "pb" in h:
        task = Task()
        task.ParseFromString(h["pb"])
        out["task"] = task_to_json(task)
    return out
