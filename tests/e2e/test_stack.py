"""The whole system as processes (issue 8): `cli.launcher.Stack` starts Redis, the engine
(tiny model), sandbox, verifier, rollout and learner; tasks go in over REST; the learner takes
steps, pushes weights and bumps versions; faults (kill -9 of verifier and learner) lose and
duplicate nothing; every dashboard panel's PromQL returns data from a real Prometheus; and the
stack leaves no process behind.

One stack serves the module's tests (starting it costs ~1 min on 2 cores); each test submits the
tasks it needs. The test that stops a stack stops the module's (the last test in file order: a
stack that served every other test, kill -9 restarts included) and the next test that needs one
starts it again.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import redis

from cli.launcher import Stack
from cli.stack_config import SERVICE_ORDER, StackConfig
from shellrl import streams
from shellrl.contract import ACTION, parse_trajectory
from tests.helpers.owned_processes import adopt_stack
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until


def tasks(prefix: str) -> list[dict]:
    """Four training tasks whose ids start with `prefix` (each test its own)."""
    return [
        {
            "task_id": f"{prefix}-{i}",
            "instruction": f"Print the number {i}. Answer with just the number.",
            "check": {"type": "answer_integer_equals", "expected": i},
            "split": "train",
            "max_turns": 2,
        }
        for i in range(4)
    ]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def start_stack(state: Path) -> Stack:
    os.chmod(state, 0o755)  # the sandbox's workspace root must be traversable by other uids
    ports = {name: free_port() for name in ("redis", *SERVICE_ORDER)}
    env = {
        "SHELLRL_CHECKPOINT_DIR": str(state / "checkpoints"),
        "SHELLRL_WEIGHT_SYNC_DIR": str(state / "weight_sync"),
        "SHELLRL_GROUP_SIZE": "2",
        "SHELLRL_GROUPS_PER_STEP": "2",
        "SHELLRL_MAX_STALENESS": "1",
        "SHELLRL_MAX_NEW_TOKENS": "8",
        "SHELLRL_MAX_TURNS": "2",
        "SHELLRL_CHECKPOINT_INTERVAL_STEPS": "1",
        # the random tiny model never succeeds: train on zero-variance groups so that every
        # step runs the whole loss path (and its metrics) instead of being skipped
        "SHELLRL_TRAIN_ZERO_VARIANCE_GROUPS": "true",
        "SHELLRL_LOG_LEVEL": "INFO",
    }
    config = StackConfig(
        state_dir=state,
        model_path="tiny",
        ports=ports,
        env=env,
        echo_logs=False,
        ready_timeout_s=240,
    )
    s = Stack(config).start()
    adopt_stack(s)
    return s


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory):
    """{"stack": the module's running stack, or None until a test needs one / after a test stopped
    it}; whatever runs at the module's end is stopped."""
    held: dict[str, Stack | None] = {"stack": None}
    yield held
    if held["stack"] is not None:
        held["stack"].stop()


@pytest.fixture
def stack(module_stack, tmp_path_factory):
    """The module's stack, started on first use and again after a test stopped it."""
    if module_stack["stack"] is None:
        module_stack["stack"] = start_stack(tmp_path_factory.mktemp("stack"))
    return module_stack["stack"]


_wait = functools.partial(wait_until, poll_s=1.0)  # the whole stack runs on 2 cores: poll gently


def _auth(stack: Stack) -> dict:
    return stack.config.auth_headers()


def _learner_step(stack: Stack) -> int:
    try:
        return int(
            httpx.get(f"{stack.config.url('learner')}/v1/status", timeout=5, headers=_auth(stack))
            .json()
            .get("step")
            or 0
        )
    except (httpx.HTTPError, ValueError):
        return -1


def _trajectories(r: redis.Redis, stream: str) -> list:
    return [parse_trajectory(fields[b"pb"]) for _, fields in r.xrange(stream)]


def _submit(stack: Stack, prefix: str) -> httpx.Response:
    resp = httpx.post(
        f"{stack.config.url('rollout')}/v1/tasks",
        json=tasks(prefix),
        timeout=30,
        headers=_auth(stack),
    )
    assert resp.status_code == 201, resp.text
    return resp


def test_tasks_posted_over_rest_lead_to_learner_steps_weight_pushes_and_version_bumps(stack):
    rollout = stack.config.url("rollout")
    refused = httpx.post(f"{rollout}/v1/tasks", json=tasks("rest"), timeout=30)  # the token only
    assert refused.status_code == 401 and refused.json()["error"]["field"] == "Authorization"
    r = redis.Redis.from_url(stack.config.redis_url)
    step, version = max(_learner_step(stack), 0), int(r.get(streams.POLICY_VERSION_KEY) or 0)
    assert _submit(stack, "rest").json()["created"] == 4
    _wait(lambda: _learner_step(stack) >= step + 2, 420, "2 learner steps")
    # the step counts once the optimizer stepped; its version is published after the weight push
    _wait(
        lambda: int(r.get(streams.POLICY_VERSION_KEY) or 0) >= version + 2,
        60,
        "2 more versions published",
    )
    engine_version = httpx.get(
        f"{stack.config.url('engine')}/get_weight_version", timeout=5, headers=_auth(stack)
    ).json()
    assert int(engine_version["weight_version"]) >= version + 2
    status = httpx.get(
        f"{stack.config.url('learner')}/v1/status", timeout=5, headers=_auth(stack)
    ).json()
    assert status["last_step"]["trajectories"] >= 2


def test_trajectories_carry_the_versions_that_produced_them(stack):
    r = redis.Redis.from_url(stack.config.redis_url)
    _submit(stack, "versions")
    _wait(
        lambda: any(
            s.policy_version >= 1
            for t in _trajectories(r, streams.STREAM_TRAJECTORIES)
            for s in t.segments
            if s.kind == ACTION
        ),
        300,
        "a trajectory sampled after a weight push",
    )
    versions = set()
    trajectories = _trajectories(r, streams.STREAM_TRAJECTORIES)
    final = int(r.get(streams.POLICY_VERSION_KEY))  # read after the trajectories: none is newer
    for traj in trajectories:
        actions = [s for s in traj.segments if s.kind == ACTION]
        assert actions, traj.trajectory_id
        for seg in actions:
            assert 0 <= seg.policy_version <= final
            versions.add(seg.policy_version)
        # admission bounds staleness: a trajectory is never started more than max_staleness + 1
        # versions before the learner version that was current when it was admitted
        assert traj.scored and traj.reward in (0.0, 1.0)
    assert 0 in versions and max(versions) >= 1


def test_kill_9_of_verifier_and_learner_loses_and_duplicates_nothing(stack):
    r = redis.Redis.from_url(stack.config.redis_url)
    _submit(stack, "kill-9")
    step_before = _learner_step(stack)
    stack.kill("verifier")
    stack.kill("learner")
    time.sleep(2)
    stack.restart("verifier")
    stack.restart("learner")
    adopt_stack(stack)
    _wait(
        lambda: _learner_step(stack) >= max(step_before, 0) + 2,
        420,
        "2 more learner steps after the restart",
    )
    learner = stack.config.url("learner")
    httpx.post(f"{learner}/v1/pause", timeout=30, headers=_auth(stack))
    try:
        # every published episode is scored exactly once (or still on its way: wait for the
        # verifier)
        def drained():
            episodes = {t.trajectory_id for t in _trajectories(r, streams.STREAM_EPISODES)}
            scored = [t.trajectory_id for t in _trajectories(r, streams.STREAM_TRAJECTORIES)]
            return episodes <= set(scored) and (episodes, scored)

        episodes, scored = _wait(drained, 180, "the verifier to score every episode")
        assert len(scored) == len(set(scored)), "a trajectory was scored twice"

        # no trajectory trained twice: the ledger's last record of each step (a resume rolls back
        # the steps after its checkpoint) names disjoint trajectory ids
        ledger = Path(stack.config.env["SHELLRL_CHECKPOINT_DIR"]) / "steps.jsonl"
        records: dict[int, dict] = {}
        for line in ledger.read_text().splitlines():
            rec = json.loads(line)
            if "event" in rec:
                records = {k: v for k, v in records.items() if k <= rec["step"]}
            else:
                records[rec["step"]] = rec
        trained = [tid for rec in records.values() for tid in rec.get("trajectory_ids", [])]
        assert len(trained) == len(set(trained)), "a trajectory was trained twice"
        assert set(trained) <= set(scored)
    finally:  # the module's learner takes steps again, for the tests after this one
        httpx.post(f"{learner}/v1/resume", timeout=30, headers=_auth(stack))


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="Debian's prometheus is not installed"
)
def test_every_dashboard_panel_returns_data_from_the_running_stack(stack, tmp_path):
    from tests.helpers.prometheus import PrometheusServer, evaluate, panel_queries

    _submit(stack, "panels")
    targets = {name: [f"127.0.0.1:{stack.config.ports[name]}"] for name in SERVICE_ORDER}
    queries = panel_queries()
    assert queries
    with PrometheusServer(tmp_path / "prom", targets) as prom:
        # rates need two scrapes that both saw traffic: let the stack work for a while
        deadline = time.monotonic() + 240
        while True:
            results = evaluate(prom, queries)
            empty = [q for q in results if not q.has_data]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(5)
    assert not empty, "panels without data:\n" + "\n".join(
        f"{q.query}: {q.error or 'empty'}" for q in empty
    )


def test_stop_leaves_no_process_behind(stack, module_stack):
    """The module's stack (started afresh if this test runs first or alone), stopped after this
    test's first episode was scored: sandbox sessions, engine and learner all had work."""
    module_stack["stack"] = None  # stopped here, whatever happens: the next test starts another
    try:
        _submit(stack, "stop")
        r = redis.Redis.from_url(stack.config.redis_url)
        _wait(
            lambda: any(
                t.task_id.startswith("stop-") for t in _trajectories(r, streams.STREAM_TRAJECTORIES)
            ),
            300,
            "a first scored episode",
        )
    except BaseException:
        stack.stop()
        raise
    pids = {p.name: p.popen.pid for p in stack.procs}
    assert set(pids) == {"redis", *SERVICE_ORDER}
    stack.stop()
    for name, pid in pids.items():
        assert not _process_alive(pid), f"{name} (pid {pid}) is still running"
        assert _group_members(pid) == [], f"{name}'s process group still has members"
    assert not stack.pid_file.exists()
