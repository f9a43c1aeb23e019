"""Chaos (issue 15): the whole stack (cli.launcher.Stack: real Redis with AOF, the services as
processes, the tiny transformer, real sandboxes) trains while faults hit it one at a time:

    SIGKILL + restart of rollout, verifier, learner, sandbox, engine (each once)
    SIGSTOP of the engine past the weight-sync deadline, then SIGCONT
    restart of Redis (SIGTERM: its AOF is fsynced; a new redis-server on the same AOF and port)

After each fault the run waits for learner steps (full form 3, quick 1). Then the learner is
paused, the gateway fills its admission window, everything in flight drains, the learner
checkpoints, and one MULTI/EXEC snapshot of the streams is counted against the learner's
checkpoint and step ledger:

    lost           published episodes neither trained/dropped by the learner (its checkpoint's
                   consumed ids), nor dead-lettered, nor still unacknowledged at a stage
    trained twice  trajectory ids in more than one step of the surviving history (steps.jsonl)
    scored twice   trajectory ids on shellrl:trajectories more than once
    task records   tasks whose episodes_scored differs from their scored trajectories on the stream
    window         counted groups really waiting for the learner (>= 2 members not INFRA) against
                   what the gateway counts (groups_admitted - version * groups_per_step) and the
                   configured size ((max_staleness + 1) * groups_per_step): a leaked admission slot
                   shows as fewer groups waiting than counted
    stretch        per fault, the longest time without a learner step from the fault's start to
                   the next fault (issue 15: < 60 s, checked by the full form on an idle machine;
                   the quick form reports it and checks recovery within FAULT_RECOVERY_S)

Quick form (in `make test`; 1-2 min on the shared 2-core VM, most of it the stack's start-up):
QUICK_FAULTS, one step after each. Full form: `make chaos`
(SHELLRL_CHAOS=full; every fault; SHELLRL_CHAOS_ROUNDS=n applies them n times over; its last
result is in BENCHMARKS.md). SHELLRL_CHAOS_RESULT=path writes the result as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from cli.launcher import Stack
from cli.stack_config import SERVICE_ORDER, StackConfig
from cli.stack_status import collect, down_parts
from services.learner.checkpoint import surviving_steps
from shellrl import streams
from shellrl.contract import is_infra, parse_trajectory
from shellrl.streams.keys import ADMITTED_KEY, INFLIGHT_KEY
from tests.helpers.owned_processes import adopt_stack
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

GROUP_SIZE, GROUPS_PER_STEP, MAX_STALENESS = 2, 2, 1
WEIGHT_SYNC_TIMEOUT_S = 8.0
ENGINE_STOP_S = WEIGHT_SYNC_TIMEOUT_S + 4.0  # at least: past the deadline of a push meanwhile
ENGINE_STOP_MAX_S = 45.0  # at most, waiting for a push to miss its deadline (a step needs groups)
MAX_STRETCH_S = 60.0  # issue 15: training resumes within 60 s of every fault
BUSY_WAIT_S = 30.0
HEALTHY_WITHIN_S = 120.0  # at the end every service answers ready within this time (a deadline)
FAULT_RECOVERY_S = 300.0  # a fault whose steps do not come within this time fails
FULL_FAULTS = (
    "kill rollout",
    "kill verifier",
    "kill learner",
    "kill sandbox",
    "kill engine",
    "stop engine",
    "restart redis",
)
QUICK_FAULTS = ("kill rollout", "kill learner", "restart redis")
TASKS = [
    {
        "task_id": f"chaos-{i}",
        "instruction": f"Print the number {i}. Answer with just the number.",
        "check": {"type": "answer_integer_equals", "expected": i},
        "split": "train",
        "max_turns": 2,
    }
    for i in range(8)
]


@dataclass
class ChaosResult:
    faults: list[str]
    fault_times: list[tuple[float, float]] = field(default_factory=list)  # (start, back) unix s
    stretch_s: dict[str, float] = field(default_factory=dict)
    push_missed_deadline: list[bool] = field(default_factory=list)  # per engine stop
    steps: int = 0
    published: int = 0
    scored: int = 0
    trained: int = 0
    lost: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)
    scored_twice: list[str] = field(default_factory=list)
    dead_letters: int = 0
    task_records_off: list[str] = field(default_factory=list)
    in_flight: int = 0
    window: dict[str, int] = field(default_factory=dict)
    unhealthy: list[str] = field(default_factory=list)
    seconds: float = 0.0  # from the tasks' submission to the end of the count
    phases_s: dict[str, float] = field(default_factory=dict)


def start_stack(state: Path) -> Stack:
    started = time.monotonic()
    os.chmod(state, 0o755)  # the sandbox's workspace root must be traversable by other uids
    env = {
        "SHELLRL_CHECKPOINT_DIR": str(state / "checkpoints"),
        "SHELLRL_WEIGHT_SYNC_DIR": str(state / "weight_sync"),
        "SHELLRL_GROUP_SIZE": str(GROUP_SIZE),
        "SHELLRL_GROUPS_PER_STEP": str(GROUPS_PER_STEP),
        "SHELLRL_MAX_STALENESS": str(MAX_STALENESS),
        "SHELLRL_MAX_NEW_TOKENS": "8",
        "SHELLRL_MAX_TURNS": "2",
        "SHELLRL_CHECKPOINT_INTERVAL_STEPS": "1",
        "SHELLRL_TRAIN_ZERO_VARIANCE_GROUPS": "true",  # the random tiny model never succeeds
        "SHELLRL_WEIGHT_SYNC_TIMEOUT_S": str(WEIGHT_SYNC_TIMEOUT_S),
        "SHELLRL_LOG_LEVEL": "INFO",
    }
    ports = {name: free_port() for name in ("redis", *SERVICE_ORDER)}
    config = StackConfig(
        state_dir=state,
        model_path="tiny",
        ports=ports,
        env=env,
        echo_logs=False,
        ready_timeout_s=240,
    )
    stack = Stack(config).start()
    adopt_stack(stack)
    print(f"chaos: stack up in {time.monotonic() - started:.1f} s")
    return stack


def apply_fault(stack: Stack, r: redis.Redis, fault: str) -> tuple[float, float, bool]:
    """Apply `fault` (see FULL_FAULTS); returns (start, back, missed): unix times of the fault
    and of the moment its service answered /readyz again (Redis: PING), and for a stop whether a
    weight push missed its deadline meanwhile. Verifier, learner and gateway are killed while
    they have work in flight (`_BUSY`, polled for up to BUSY_WAIT_S)."""
    action, name = fault.split()
    if action == "kill" and name in _BUSY:
        deadline = time.monotonic() + BUSY_WAIT_S
        while not _BUSY[name](r) and time.monotonic() < deadline:
            time.sleep(0.01)
    start, missed = time.time(), False
    if action == "kill":
        stack.kill(name)  # SIGKILL of its process group
        stack.restart(name)
    elif action == "stop":  # until a weight push has missed its deadline (the learner says so)
        pgid = stack.proc(name).popen.pid
        os.killpg(pgid, signal.SIGSTOP)
        try:
            time.sleep(ENGINE_STOP_S)
            deadline = time.monotonic() + ENGINE_STOP_MAX_S - ENGINE_STOP_S
            while not (missed := _push_missed_deadline(stack)) and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            os.killpg(pgid, signal.SIGCONT)
    elif action == "restart":
        stack.restart(name, signal.SIGTERM)
    else:
        raise ValueError(fault)
    adopt_stack(stack)  # the restarted process
    return start, time.time(), missed


_BUSY = {  # a service is killed while this holds: it has work in flight
    "verifier": lambda r: r.xpending(streams.STREAM_EPISODES, streams.GROUP_VERIFIER)["pending"],
    "learner": lambda r: r.xpending(streams.STREAM_TRAJECTORIES, streams.GROUP_LEARNER)["pending"],
    "rollout": lambda r: r.zcard(INFLIGHT_KEY) >= 2,  # groups admitted, episodes running
}


def _push_missed_deadline(stack: Stack) -> bool:
    """The learner took an engine out of rotation because its push missed the deadline."""
    sync = _call(stack, "get", "learner", "/v1/status").json()["weight_sync"]
    return any(
        not e["in_rotation"] and "deadline" in (e.get("last_error") or "") for e in sync["engines"]
    )


def run_chaos(stack: Stack, faults: tuple[str, ...], steps_after_fault: int) -> ChaosResult:
    started = time.time()
    result = ChaosResult(list(faults))
    r = redis.Redis.from_url(stack.config.redis_url)
    resp = _call(stack, "post", "rollout", "/v1/tasks", json=TASKS)
    assert resp.status_code == 201, resp.text
    _wait_steps(stack, started, steps_after_fault, "the first steps")
    result.phases_s["first steps"] = round(time.time() - started, 1)
    for fault in faults:
        start, back, missed = apply_fault(stack, r, fault)
        result.fault_times.append((start, back))
        if fault.startswith("stop"):
            result.push_missed_deadline.append(missed)
        _wait_steps(stack, back, steps_after_fault, f"{steps_after_fault} steps after {fault}")
    ledger = _ledger(stack)
    result.stretch_s = stretches(ledger, faults, result.fault_times)
    result.phases_s["faults"] = round(time.time() - started - sum(result.phases_s.values()), 1)
    quiesce(stack, r)
    result.phases_s["drain"] = round(time.time() - started - sum(result.phases_s.values()), 1)
    count(stack, r, ledger, result)
    _call(stack, "post", "learner", "/v1/resume")
    _wait_steps(stack, time.time(), 1, "a step after the count")
    info = json.loads(stack.pid_file.read_text())
    deadline = time.monotonic() + HEALTHY_WITHIN_S  # a /readyz may time out on a busy machine
    while (down := down_parts(collect(info))) and time.monotonic() < deadline:
        time.sleep(1.0)
    result.unhealthy = down
    result.phases_s["count, resume"] = round(
        time.time() - started - sum(result.phases_s.values()), 1
    )
    result.seconds = round(time.time() - started, 1)
    r.close()
    return result


def stretches(ledger: list[dict], faults, times) -> dict[str, float]:
    """Per fault: the longest gap between its start, the steps finished after it, and the next
    fault's start (the last fault: its last step counted)."""
    finished = sorted(rec["finished_at"] for rec in ledger if "finished_at" in rec)
    out, seen = {}, Counter()
    for i, fault in enumerate(faults):
        start = times[i][0]
        end = times[i + 1][0] if i + 1 < len(faults) else finished[-1]
        marks = [start, *(t for t in finished if start < t <= end)]
        seen[fault] += 1
        name = fault if seen[fault] == 1 else f"{fault} ({seen[fault]})"
        out[name] = round(max(b - a for a, b in zip(marks, marks[1:])), 1)
    return out


def quiesce(stack: Stack, r: redis.Redis) -> None:
    """Pause the learner; wait until the gateway has filled its window and finished every group,
    and the verifier and the gateway's stats consumer took every entry; checkpoint."""
    assert _call(stack, "post", "learner", "/v1/pause?wait=true").status_code == 200

    def drained() -> bool:
        adm = _call(stack, "get", "rollout", "/v1/status").json()["admission"]
        return (
            not adm["can_admit"]
            and adm["groups_in_flight"] == 0
            and _group_idle(r, streams.STREAM_EPISODES, streams.GROUP_VERIFIER)
            and _group_idle(r, streams.STREAM_TRAJECTORIES, "rollout-stats")
        )

    wait_until(drained, 240, "the gateway's window filled and every stage drained", poll_s=1.0)
    assert _call(stack, "post", "learner", "/v1/checkpoints").status_code == 201


def count(stack: Stack, r: redis.Redis, ledger: list[dict], result: ChaosResult) -> None:
    """The counts of the module docstring, from one MULTI/EXEC snapshot of Redis."""
    with r.pipeline(transaction=True) as pipe:
        pipe.xrange(streams.STREAM_EPISODES)
        pipe.xrange(streams.STREAM_TRAJECTORIES)
        pipe.xrange(streams.STREAM_DEAD)
        for stream, group in _STAGES:
            pipe.xinfo_groups(stream)
            pipe.xpending_range(stream, group, "-", "+", 100_000)
        pipe.get(ADMITTED_KEY)
        pipe.get(streams.POLICY_VERSION_KEY)
        episodes, trajectories, dead, *stages, admitted, published_version = pipe.execute()
    published = _by_entry(episodes)
    scored = _by_entry(trajectories)
    unacked = [
        _unacked(entries, infos, pending, group)
        for (entries, (_, group)), infos, pending in zip(
            ((published, _STAGES[0]), (scored, _STAGES[1])), stages[0::2], stages[1::2]
        )
    ]
    dead_ids = {parse_trajectory(f[b"pb"]).trajectory_id for _, f in dead}
    consumed = set(_checkpoint_state(stack)["consumed_ids"])
    scored_ids = {t.trajectory_id for t in scored.values()}
    lost = {t.trajectory_id for e, t in published.items() if e not in unacked[0]} - scored_ids
    lost |= {t.trajectory_id for e, t in scored.items() if e not in unacked[1]} - consumed
    trained = Counter(
        tid for rec in surviving_steps(ledger).values() for tid in rec.get("trajectory_ids", [])
    )
    per_id = Counter(t.trajectory_id for t in scored.values())
    result.steps = max((rec["step"] for rec in ledger if "finished_at" in rec), default=0)
    result.published, result.scored = len(published), len(scored_ids)
    result.trained = len(trained)
    result.lost = sorted(lost - dead_ids)
    result.trained_twice = sorted(t for t, n in trained.items() if n > 1)
    result.scored_twice = sorted(t for t, n in per_id.items() if n > 1)
    result.dead_letters = len(dead)
    result.in_flight = len(unacked[0]) + len(unacked[1])
    result.task_records_off = _task_records_off(r, scored.values())
    version = int(_call(stack, "get", "learner", "/v1/status").json()["step"])
    waiting = Counter(scored[e].group_id for e in unacked[1] if not is_infra(scored[e].failure))
    result.window = {
        "configured": (MAX_STALENESS + 1) * GROUPS_PER_STEP,
        "counted_by_gateway": int(admitted or 0) - version * GROUPS_PER_STEP,
        "groups_waiting": sum(1 for n in waiting.values() if n >= 2),
        # what the gateway's bound is computed from, against the learner's step (`version`):
        # a window short of `configured` with these apart is a version the learner did not publish
        "learner_step": version,
        "published_version": int(published_version or 0),
    }


_STAGES = (
    (streams.STREAM_EPISODES, streams.GROUP_VERIFIER),
    (streams.STREAM_TRAJECTORIES, streams.GROUP_LEARNER),
)


def _by_entry(entries) -> dict:
    return {eid.decode(): parse_trajectory(f[b"pb"]) for eid, f in entries}


def _unacked(entries: dict, infos: list, pending: list, group: str) -> set[str]:
    """Entry ids `group` has not acknowledged: pending, or past its last-delivered id."""
    info = next(i for i in infos if i["name"].decode() == group)
    last = tuple(map(int, info["last-delivered-id"].decode().split("-")))
    out = {p["message_id"].decode() for p in pending}
    return out | {e for e in entries if tuple(map(int, e.split("-"))) > last}


def _task_records_off(r: redis.Redis, scored) -> list[str]:
    """Tasks whose record counts another number of scored episodes than the stream holds."""
    on_stream = Counter(t.task_id for t in scored if t.scored)
    off = []
    for task in TASKS:
        recorded = int(r.hget(streams.task_key(task["task_id"]), "episodes_scored") or 0)
        if recorded != on_stream[task["task_id"]]:
            off.append(f"{task['task_id']}: record {recorded}, stream {on_stream[task['task_id']]}")
    return off


def _checkpoint_state(stack: Stack) -> dict:
    directory = Path(stack.config.env["SHELLRL_CHECKPOINT_DIR"])
    latest = sorted(directory.glob("step-*/state.json"))[-1]
    return json.loads(latest.read_text())


def _group_idle(r: redis.Redis, stream: str, group: str) -> bool:
    infos = [i for i in r.xinfo_groups(stream) if i["name"].decode() == group]
    return bool(infos) and infos[0]["pending"] == 0 and infos[0]["lag"] == 0


def _ledger(stack: Stack) -> list[dict]:
    path = Path(stack.config.env["SHELLRL_CHECKPOINT_DIR"]) / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_steps(stack: Stack, after: float, n: int, what: str) -> None:
    wait_until(
        lambda: sum(rec.get("finished_at", 0) > after for rec in _ledger(stack)) >= n,
        FAULT_RECOVERY_S,
        what,
        poll_s=0.5,
    )


def _call(stack: Stack, method: str, service: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(
        method.upper(),
        f"{stack.config.url(service)}{path}",
        headers=stack.config.auth_headers(),
        timeout=60,
        **kwargs,
    )


def check(result: ChaosResult, *, timed: bool = True) -> None:
    """Assert the counts; `timed`: also that no step-less stretch reached MAX_STRETCH_S."""
    print("chaos result:", json.dumps(asdict(result)))
    if path := os.environ.get("SHELLRL_CHAOS_RESULT"):
        Path(path).write_text(json.dumps(asdict(result), indent=2))
    assert result.lost == [], f"lost: {result.lost}"
    assert result.trained_twice == [], f"trained twice: {result.trained_twice}"
    assert result.scored_twice == [], f"scored twice: {result.scored_twice}"
    assert result.dead_letters == 0, "healthy entries were dead-lettered"
    assert result.task_records_off == [], result.task_records_off
    window = result.window
    assert window["groups_waiting"] == window["counted_by_gateway"] == window["configured"], window
    assert result.unhealthy == [], f"down at the end: {result.unhealthy}"
    assert all(result.push_missed_deadline), "an engine stop saw no weight push miss its deadline"
    if timed:  # a measurement: only where the machine is known to be idle (`make chaos`)
        slow = {f: s for f, s in result.stretch_s.items() if s >= MAX_STRETCH_S}
        assert not slow, f"step-less stretches of {MAX_STRETCH_S:g} s or more: {slow}"


def test_quick_chaos_loses_nothing_trains_nothing_twice_and_recovers(tmp_path):
    """Recovery is asserted as training resuming after every fault within FAULT_RECOVERY_S (a
    deadline a loaded machine meets too: a CI run beside CPU burners measured a 61 s stretch after
    the learner's kill); the stretches themselves are printed with the result, and the 60 s
    target of issue 15 is checked by the full form, `make chaos`, on an idle machine."""
    stack = start_stack(tmp_path)
    try:
        check(run_chaos(stack, QUICK_FAULTS, steps_after_fault=1), timed=False)
    finally:
        stack.stop(grace_s=1.0)  # counted already: no need to drain


@pytest.mark.skipif(
    os.environ.get("SHELLRL_CHAOS") != "full", reason="the full form runs with `make chaos`"
)
def test_full_chaos_every_fault_loses_nothing_and_recovers_within_a_minute(tmp_path):
    stack = start_stack(tmp_path)
    try:
        rounds = int(os.environ.get("SHELLRL_CHAOS_ROUNDS") or 1)
        check(run_chaos(stack, FULL_FAULTS * rounds, steps_after_fault=3))
    finally:
        stack.stop()
