"""Transcripts: one finished trajectory as the policy saw it, for `GET /v1/trajectories/{id}`,
and the newest ones of one task, for `GET /v1/trajectories?task_id=`.

Where a finished trajectory is kept: the verifier appends each one it handled to
shellrl:trajectories (training episodes, scored or passed through with a failure) or
shellrl:evaluations (`Trajectory.eval`), under the idempotency key
`shellrl:idem:<stream>:<trajectory_id>` whose value is the entry id (kept an hour,
shellrl.streams.producer.IDEMPOTENCY_TTL_S). A lookup reads that key and then the one entry (XRANGE id id); when the
key is gone or empty, the newest `SCAN_LIMIT` entries of each stream are searched instead. A
trajectory trimmed from its stream is unknown (None).

The view decodes every segment's int32 token ids with the gateway's tokenizer (special tokens
kept, as the policy saw them); non-finite floats (reward and training_reward of an unscored
trajectory are NaN) become null.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

from shellrl.contract import ContractError, failure_label, parse_trajectory, task_to_json
from shellrl.contract.trajectory import ACTION, decode_token_ids
from shellrl.streams import STREAM_EVALUATIONS, STREAM_TRAJECTORIES, idempotency_key, tag
from shellrl.v1.trajectory_pb2 import EpisodeEnd, FinishReason, Segment, Trajectory

STREAMS = (STREAM_TRAJECTORIES, STREAM_EVALUATIONS)
# entries per stream searched, newest first, when the idempotency key is gone (past its hour):
# an unknown id reads up to this many whole trajectories (tens of kB each), so it stays small
SCAN_LIMIT = 1_000
SCAN_PAGE = 200


def _places(
    redis: aioredis.Redis, shards: Sequence[aioredis.Redis]
) -> list[tuple[aioredis.Redis, str, int]]:
    """(client, stream, shard) of every kept stream: both on the control Redis (shard 0), then
    shellrl:trajectories on stream shards 1.. (`shards`; shellrl/streams/shards.py)."""
    here = [(redis, stream, 0) for stream in STREAMS]
    return here + [(c, STREAM_TRAJECTORIES, k) for k, c in enumerate(shards, start=1)]


async def find_trajectory(
    redis: aioredis.Redis, trajectory_id: str, shards: Sequence[aioredis.Redis] = ()
) -> tuple[Trajectory, str, str] | None:
    """(trajectory, stream, entry id) of the finished trajectory `trajectory_id`, or None when no
    kept stream holds it. `shards`: the clients of stream shards 1.. (their entry ids come back
    tagged "<k>@<id>"). Raises redis.RedisError when Redis does not answer."""
    places = _places(redis, shards)
    for client, stream, shard in places:
        entry_id = await client.get(idempotency_key(stream, trajectory_id))
        if entry_id:
            for eid, fields in await client.xrange(stream, entry_id, entry_id, count=1):
                traj = _parse(fields.get(b"pb", b""), trajectory_id)
                if traj is not None:
                    return traj, stream, tag(_s(eid), shard)
    needle = trajectory_id.encode()
    for client, stream, shard in places:
        last, seen = "+", 0
        while seen < SCAN_LIMIT:
            rows = await client.xrevrange(stream, last, "-", count=SCAN_PAGE)
            for eid, fields in rows:
                pb = fields.get(b"pb", b"")
                if needle in pb and (traj := _parse(pb, trajectory_id)) is not None:
                    return traj, stream, tag(_s(eid), shard)
            if len(rows) < SCAN_PAGE:
                break
            seen += len(rows)
            last = f"({_s(rows[-1][0])}"
    return None


async def find_task_trajectories(
    redis: aioredis.Redis, task_id: str, limit: int = 10, shards: Sequence[aioredis.Redis] = ()
) -> list[tuple[Trajectory, str, str]]:
    """[(trajectory, stream, entry id)] of the newest finished trajectories of task `task_id`, at
    most `limit`, newest `finished_at` first: the newest `SCAN_LIMIT` entries of each kept stream
    (and of shellrl:trajectories on each stream shard of `shards`) are searched by their
    `task_id` field (an older trajectory is not found here; its id still is, through
    `find_trajectory`). Raises redis.RedisError when Redis does not answer."""
    needle = task_id.encode()
    found: list[tuple[Trajectory, str, str]] = []
    for client, stream, shard in _places(redis, shards):
        last, seen, hits = "+", 0, 0
        while seen < SCAN_LIMIT and hits < limit:
            rows = await client.xrevrange(stream, last, "-", count=SCAN_PAGE)
            for eid, fields in rows:
                if fields.get(b"task_id") != needle or hits >= limit:
                    continue
                try:
                    traj = parse_trajectory(fields.get(b"pb", b""))
                except ContractError:
                    continue
                found.append((traj, stream, tag(_s(eid), shard)))
                hits += 1
            if len(rows) < SCAN_PAGE:
                break
            seen += len(rows)
            last = f"({_s(rows[-1][0])}"
    found.sort(key=lambda f: f[0].finished_at, reverse=True)
    return found[:limit]


def trajectory_summary(traj: Trajectory, *, stream: str = "", entry_id: str = "") -> dict:
    """One line of `GET /v1/trajectories?task_id=`: trajectory_id, stream, entry_id, eval,
    evaluation_id, scored, reward (null when unscored), failure, checks_passed / checks (counts),
    finished_at (unix s)."""
    return {
        "trajectory_id": traj.trajectory_id,
        "stream": stream,
        "entry_id": entry_id,
        "eval": traj.eval,
        "evaluation_id": traj.evaluation_id,
        "scored": traj.scored,
        "reward": _finite(traj.reward),
        "failure": failure_label(traj.failure),
        "checks_passed": sum(c.passed for c in traj.checks),
        "checks": len(traj.checks),
        "finished_at": traj.finished_at,
    }


def transcript(
    traj: Trajectory, decode: Callable[[list[int]], str], *, stream: str = "", entry_id: str = ""
) -> dict:
    """The JSON view of one trajectory. `decode`: token ids -> text (ChatFormat.decode).

    Keys: ids and provenance (`stream`, `entry_id`, versions of env/harness/verifier), `task`
    (the task JSON as the gateway ran it), `prompt` {text, token_ids}, `turns`: a list of
    {turn, segments}, each segment {kind action|observation, text, token_ids, policy_version
    (-1 for observations), finish_reason, and for an observation `tool` (command, exit_code,
    duration_ms, timed_out, truncated bytes, policy verdict/rule, parse_error)}, then `answer`,
    `end`, `reward`, `training_reward`, `reward_components`, `checks` (the verifier's per-check
    results in task order: type, passed, detail, duration_ms; empty when a check could not run or
    the trajectory was not verified), `scored`, `failure` (lower-case class
    without FAILURE_, "none" when none), `failure_detail`, `policy_versions` (distinct ACTION
    versions, ascending), timestamps (unix s)."""
    turns: dict[int, list[dict]] = {}
    for seg in traj.segments:
        turns.setdefault(seg.turn, []).append(_segment(seg, decode))
    prompt_ids = decode_token_ids(traj.prompt_ids).tolist()
    return {
        "trajectory_id": traj.trajectory_id,
        "task_id": traj.task_id,
        "group_id": traj.group_id,
        "attempt": traj.attempt,
        "eval": traj.eval,
        "evaluation_id": traj.evaluation_id,
        "split": traj.split,
        "source": traj.source,
        "stream": stream,
        "entry_id": entry_id,
        "versions": {
            "env": traj.env_version,
            "harness": traj.harness_version,
            "verifier": traj.verifier_version,
        },
        "task": task_to_json(traj.task) if traj.HasField("task") else None,
        "prompt": {"text": decode(prompt_ids), "token_ids": prompt_ids},
        "turns": [{"turn": t, "segments": segs} for t, segs in sorted(turns.items())],
        "num_turns": traj.num_turns,
        "answer": traj.answer,
        "end": EpisodeEnd.Name(traj.end).removeprefix("EPISODE_END_").lower(),
        "terminated": traj.terminated,
        "truncated": traj.truncated,
        "scored": traj.scored,
        "reward": _finite(traj.reward),
        "training_reward": _finite(traj.training_reward),
        "reward_components": {k: _finite(v) for k, v in sorted(traj.reward_components.items())},
        "checks": [
            {"type": c.type, "passed": c.passed, "detail": c.detail, "duration_ms": c.duration_ms}
            for c in traj.checks
        ],
        "failure": failure_label(traj.failure),
        "failure_detail": traj.failure_detail,
        "safety_events": list(traj.safety_events),
        "policy_versions": sorted(
            {s.policy_version for s in traj.segments if s.kind == ACTION and s.token_ids}
        ),
        "created_at": traj.created_at,
        "finished_at": traj.finished_at,
        "scored_at": traj.scored_at,
    }


def _segment(seg: Segment, decode: Callable[[list[int]], str]) -> dict:
    ids = decode_token_ids(seg.token_ids).tolist()
    out = {
        "kind": "action" if seg.kind == ACTION else "observation",
        "text": decode(ids),
        "token_ids": ids,
        "policy_version": seg.policy_version,
        "finish_reason": FinishReason.Name(seg.finish_reason)
        .removeprefix("FINISH_REASON_")
        .lower(),
    }
    if seg.kind != ACTION and seg.HasField("tool_event"):
        ev = seg.tool_event
        out["tool"] = {
            "command": ev.command,
            "exit_code": ev.exit_code,
            "duration_ms": ev.duration_ms,
            "timed_out": ev.timed_out,
            "stdout_truncated_bytes": ev.stdout_truncated_bytes,
            "stderr_truncated_bytes": ev.stderr_truncated_bytes,
            "policy_verdict": ev.policy_verdict,
            "policy_rule": ev.policy_rule,
            "parse_error": ev.parse_error,
        }
    return out


def _parse(pb: bytes, trajectory_id: str) -> Trajectory | None:
    try:
        traj = parse_trajectory(pb)
    except ContractError:
        return None
    return traj if traj.trajectory_id == trajectory_id else None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
