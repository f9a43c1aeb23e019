"""Evaluations: a fixed budget of episodes on the eval split (or given tasks), scored by the verifier.

`POST /v1/evaluations` creates a record and runs its episodes in the background; eval episodes
never enter the training stream: each finished episode goes to the verifier's synchronous
`POST /v1/verify` (which releases the sandbox session), and the result is appended to the record.
The scored trajectory (reward, its components, failure class and verifier version written into it)
is appended to `shellrl:evaluations` under its `trajectory_id`, as the verifier's stream worker
stores training trajectories, so `GET /v1/trajectories/{id}` and `shellrl show` find it
(transcripts.py); a failed append is logged and never fails the evaluation.

Redis: shellrl:evaluation:{id} (hash: `meta` JSON, `state`), shellrl:evaluation:{id}:results (list
of per-episode JSON), shellrl:evaluations:index (zset by creation time). A record still `running`
when the gateway starts again is marked `interrupted` (its finished episodes stay).

Outcome of one episode (`outcome`): success (reward 1), wrong (scored, reward < 1: answered wrong
or no answer), or the failure class (infra_engine, infra_sandbox, infra_verifier, timeout_budget,
infra_rollout). `success_rate` and `mean_reward` are over scored episodes; failures are counted
apart, never as 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.rollout import metrics as m
from services.rollout.agent_loop import AgentLoop
from services.rollout.episode_spec import EpisodeSpec, Sampling
from services.rollout.seeding import eval_episode_seed
from services.rollout.task_store import TaskStore
from shellrl.clients.verifier import VerifierClient
from shellrl.contract import (
    EpisodeEnd,
    Failure,
    Task,
    Trajectory,
    failure_label,
    min_policy_version,
)
from shellrl.contract.trajectory import set_check_results
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import POLICY_VERSION_KEY, STREAM_EVALUATIONS, StreamProducer
from shellrl.streams.keys import EVALUATION_INDEX_KEY, evaluation_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluationPlan:
    task_ids: list[str]
    episodes_per_task: int
    sampling: Sampling
    max_turns: int | None
    split: str | None


class Evaluations:
    def __init__(
        self,
        redis: aioredis.Redis,
        store: TaskStore,
        agent: AgentLoop,
        verifier: VerifierClient,
        *,
        max_in_flight: int,
        sampling_seed: int | None = None,
    ) -> None:
        """sampling_seed: sampled (not greedy) eval episodes draw with seeds derived from it, the
        task and the episode index, the same in every evaluation (seeding.py); None: unseeded."""
        self.redis, self.store, self.agent, self.verifier = redis, store, agent, verifier
        self.sampling_seed = sampling_seed
        self._slots = asyncio.Semaphore(max_in_flight)
        self._stored = StreamProducer(redis, STREAM_EVALUATIONS)
        self._running: dict[str, asyncio.Task] = {}
        self._in_flight = 0

    async def mark_interrupted(self) -> int:
        """At start-up: records left `running` by a previous process become `interrupted`."""
        n = 0
        for raw in await self.redis.zrange(EVALUATION_INDEX_KEY, 0, -1):
            key = evaluation_key(raw.decode())
            if (await self.redis.hget(key, "state")) == b"running":
                await self.redis.hset(
                    key, mapping={"state": "interrupted", "finished_at": f"{time.time():.3f}"}
                )
                n += 1
        return n

    async def start(self, plan: EvaluationPlan) -> dict:
        evaluation_id = f"eval-{uuid.uuid4().hex[:12]}"
        raw_version = await self.redis.get(POLICY_VERSION_KEY)
        version = int(raw_version) if raw_version is not None else 0
        meta = {
            "evaluation_id": evaluation_id,
            "split": plan.split,
            "task_ids": plan.task_ids,
            "episodes_per_task": plan.episodes_per_task,
            "sampling": plan.sampling.model_dump(),
            "max_turns": plan.max_turns,
            "policy_version": version,
            "budget_episodes": len(plan.task_ids) * plan.episodes_per_task,
        }
        now = time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                evaluation_key(evaluation_id),
                mapping={"meta": json.dumps(meta), "state": "running", "created_at": f"{now:.3f}"},
            )
            pipe.zadd(EVALUATION_INDEX_KEY, {evaluation_id: now})
            await pipe.execute()
        runner = asyncio.create_task(self._run(evaluation_id, plan))
        self._running[evaluation_id] = runner
        runner.add_done_callback(lambda _: self._running.pop(evaluation_id, None))
        return await self.describe(evaluation_id)

    async def _run(self, evaluation_id: str, plan: EvaluationPlan) -> None:
        state = "done"
        try:
            jobs = [
                self._episode(evaluation_id, plan, task_id, k)
                for task_id in plan.task_ids
                for k in range(plan.episodes_per_task)
            ]
            await asyncio.gather(*jobs)
        except asyncio.CancelledError:
            state = "interrupted"
            raise
        except Exception:  # recorded as the evaluation's state `failed`, logged
            log.exception("evaluation failed", extra={"evaluation_id": evaluation_id})
            state = "failed"
        finally:
            await self.redis.hset(
                evaluation_key(evaluation_id),
                mapping={"state": state, "finished_at": f"{time.time():.3f}"},
            )
            m.EVALUATIONS.labels(state).inc()

    async def _episode(
        self, evaluation_id: str, plan: EvaluationPlan, task_id: str, k: int
    ) -> None:
        task = await self.store.get_task(task_id)
        if task is None:
            await self._record(
                evaluation_id, {"task_id": task_id, "episode": k, "outcome": "unknown_task"}
            )
            return
        if plan.max_turns:
            task.max_turns = plan.max_turns
        async with self._slots:
            self._in_flight += 1
            m.EVAL_EPISODES_IN_FLIGHT.set(self._in_flight)
            try:
                spec = EpisodeSpec(
                    task=task,
                    trajectory_id=f"{evaluation_id}-{task_id}-{k}",
                    eval=True,
                    evaluation_id=evaluation_id,
                    sampling=plan.sampling,
                    keep_session=True,
                    seed=None
                    if self.sampling_seed is None or plan.sampling.temperature <= 0
                    else eval_episode_seed(self.sampling_seed, task_id, k),
                )
                traj = await self.agent.run(spec)
                result = await self._score(task, traj)
            finally:
                self._in_flight -= 1
                m.EVAL_EPISODES_IN_FLIGHT.set(self._in_flight)
        await self._store_trajectory(traj, result)
        await self._record(evaluation_id, {"task_id": task_id, "episode": k, **result})

    async def _score(self, task: Task, traj: Trajectory) -> dict:
        out = {
            "trajectory_id": traj.trajectory_id,
            "answer": traj.answer if traj.end == EpisodeEnd.EPISODE_END_ANSWER else None,
            "end": EpisodeEnd.Name(traj.end).removeprefix("EPISODE_END_").lower(),
            "num_turns": traj.num_turns,
            "policy_versions": sorted(
                {s.policy_version for s in traj.segments if s.kind == 1 and s.token_ids}
            ),
            "min_policy_version": min_policy_version(traj),
            "reward": None,
        }
        if traj.failure != Failure.FAILURE_NONE:
            return {
                **out,
                "outcome": failure_label(traj.failure),
                "failure_detail": traj.failure_detail,
            }
        try:
            verdict = await self.verifier.verify(task, out["answer"], traj.sandbox_session_id, traj)
        except Exception as exc:  # the verifier unreachable or failing: an infra_verifier result
            await self.agent._delete_session(traj.sandbox_session_id)
            return {**out, "outcome": "infra_verifier", "failure_detail": f"verifier: {exc}"[:1000]}
        if verdict.get("failure") or verdict.get("reward") is None:
            return {
                **out,
                "outcome": "infra_verifier",
                "failure_detail": verdict.get("failure_detail", ""),
            }
        reward = float(verdict["reward"])
        return {
            **out,
            "reward": reward,
            "outcome": "success" if reward >= 1.0 else "wrong",
            "training_reward": verdict.get("training_reward"),
            "reward_components": verdict.get("reward_components") or {},
            "safety_events": verdict.get("safety_events") or [],
            "checks": verdict.get("checks", []),
            "verifier_version": verdict.get("verifier_version"),
        }

    async def _store_trajectory(self, traj: Trajectory, result: dict) -> None:
        """Write the verdict of `result` (`_score`) into `traj` and append it to
        shellrl:evaluations, idempotent by trajectory_id. Never raises (logged)."""
        apply_verdict(traj, result)
        try:
            await self._stored.add(
                traj.SerializeToString(),
                idempotency_key=traj.trajectory_id,
                task_id=traj.task_id,
                evaluation_id=traj.evaluation_id,
            )
        except Exception:  # the stored copy is for reading back; the result is counted anyway
            log.exception(
                "storing an eval trajectory failed", extra={"trajectory_id": traj.trajectory_id}
            )

    async def _record(self, evaluation_id: str, result: dict) -> None:
        await self.redis.rpush(evaluation_key(evaluation_id) + ":results", json.dumps(result))

    async def describe(self, evaluation_id: str, *, with_results: bool = True) -> dict | None:
        """The JSON view of `GET /v1/evaluations/{id}` (None when unknown)."""
        raw = await self.redis.hgetall(evaluation_key(evaluation_id))
        if not raw:
            return None
        h = {k.decode(): v.decode() for k, v in raw.items()}
        meta = json.loads(h["meta"])
        results = [
            json.loads(r)
            for r in await self.redis.lrange(evaluation_key(evaluation_id) + ":results", 0, -1)
        ]
        outcomes = Counter(r["outcome"] for r in results)
        scored = [r for r in results if r.get("reward") is not None]
        versions = sorted({v for r in results for v in r.get("policy_versions", [])})
        out = {
            **meta,
            "state": h.get("state"),
            "created_at": float(h["created_at"]),
            "finished_at": float(h["finished_at"]) if "finished_at" in h else None,
            "episodes_done": len(results),
            "episodes_scored": len(scored),
            "success_rate": sum(r["outcome"] == "success" for r in scored) / len(scored)
            if scored
            else None,
            "mean_reward": sum(r["reward"] for r in scored) / len(scored) if scored else None,
            "outcomes": dict(outcomes),
            "failures": {k: v for k, v in outcomes.items() if k not in ("success", "wrong")},
            "policy_versions_seen": versions,
            "mixed_versions": len(versions) > 1,
        }
        if with_results:
            out["per_task"] = _per_task(results)
            out["results"] = results
        return out

    async def recent(self, limit: int = 50) -> list[dict]:
        ids = [r.decode() for r in await self.redis.zrevrange(EVALUATION_INDEX_KEY, 0, limit - 1)]
        return [
            d for d in [await self.describe(i, with_results=False) for i in ids] if d is not None
        ]

    async def shutdown(self) -> None:
        await cancel_and_wait(*self._running.values())


def apply_verdict(traj: Trajectory, result: dict) -> None:
    """Write one episode's outcome (`Evaluations._score`'s dict, from the verifier's JSON verdict)
    into `traj` as the verifier's stream worker does (verification.py `Verification.apply_to`):
    reward and training_reward (NaN when unscored), reward_components, scored, failure class and
    detail, safety events, the per-check results, verifier_version, scored_at (unix s)."""
    traj.scored_at = time.time()
    traj.verifier_version = result.get("verifier_version") or traj.verifier_version
    traj.reward_components.clear()
    set_check_results(traj, result.get("checks") or [])
    if result.get("reward") is None:
        traj.scored = False
        traj.reward = traj.training_reward = math.nan
        if traj.failure == Failure.FAILURE_NONE:
            traj.failure = Failure.FAILURE_INFRA_VERIFIER
            traj.failure_detail = result.get("failure_detail") or ""
        return
    traj.scored = True
    traj.reward = float(result["reward"])
    training = result.get("training_reward")
    traj.training_reward = traj.reward if training is None else float(training)
    traj.reward_components.update(
        {k: float(v) for k, v in (result.get("reward_components") or {}).items() if v is not None}
    )
    for rule in result.get("safety_events") or []:
        if rule not in traj.safety_events:
            traj.safety_events.append(rule)


def _per_task(results: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for r in results:
        entry = out.setdefault(
            r["task_id"], {"episodes": 0, "successes": 0, "scored": 0, "outcomes": Counter()}
        )
        entry["episodes"] += 1
        entry["outcomes"][r["outcome"]] += 1
        if r.get("reward") is not None:
            entry["scored"] += 1
            entry["successes"] += r["outcome"] == "success"
    for entry in out.values():
        entry["outcomes"] = dict(entry["outcomes"])
        entry["success_rate"] = entry["successes"] / entry["scored"] if entry["scored"] else None
    return out
