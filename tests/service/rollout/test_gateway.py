"""`python -m services.rollout` as a real process with real Redis, engine (tiny), sandbox and verifier:
REST validation, a posted task -> trajectories in shellrl:episodes -> scored -> task statistics,
admission against a learner that never advances, `shellrl submit`, an evaluation, and the sandbox
and then the engine killed mid-episode (INFRA trajectories, nothing lost, gateway healthy).

Each test gets its own Redis, verifier and gateway (nothing in Redis, the admission counter or the
gateway's pool comes from another test) and submits the tasks it needs. The engine (the package's)
and this module's sandbox are shared; a test that kills one starts it again before it returns.
"""

from __future__ import annotations

import json
import shutil
import sys
import time

import httpx
import pytest
import redis as sync_redis

from shellrl.contract import Failure, SegmentKind, parse_trajectory, trajectory_arrays
from shellrl.streams import POLICY_UPDATES_CHANNEL, POLICY_VERSION_KEY, STREAM_EPISODES
from shellrl.streams.keys import ADMITTED_KEY
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO, ServiceProcess, start_together
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until
from tests.service.rollout.conftest import start_sandbox

GROUP_SIZE, GROUPS_PER_STEP, MAX_STALENESS = 2, 2, 1
TASK = {
    "task_id": "lines-1",
    "instruction": "How many lines does numbers.txt have?",
    "setup": "seq 1 5 > numbers.txt",
    "check": {"type": "answer_integer_equals", "expected": 5},
    "tags": ["count"],
    "source": "test",
}
EVAL_TASKS = [
    dict(TASK, task_id=f"eval-{i}", split="eval", instruction=f"How many lines? ({i})")
    for i in range(3)
]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """This module's own sandbox process: its sandbox test kills it (the package's stays up)."""
    proc, root = start_sandbox(tmp_path_factory.mktemp("gateway-sandbox-logs"))
    yield proc
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def stack(redis_server, engine_process, sandbox, tmp_path):
    """A fresh Redis, verifier and gateway over the shared engine and sandbox."""
    logs = tmp_path / "logs"
    env = {"SHELLRL_REDIS_URL": redis_server.url}
    verifier = ServiceProcess(
        "verifier", free_port(), {**env, "SHELLRL_SANDBOX_URL": sandbox.url}, logs
    )
    gateway = ServiceProcess(
        "rollout",
        free_port(),
        {
            **env,
            "SHELLRL_ENGINE_URLS": engine_process.url,
            "SHELLRL_SANDBOX_URL": sandbox.url,
            "SHELLRL_VERIFIER_URL": verifier.url,
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_GROUP_SIZE": str(GROUP_SIZE),
            "SHELLRL_GROUPS_PER_STEP": str(GROUPS_PER_STEP),
            "SHELLRL_MAX_STALENESS": str(MAX_STALENESS),
            "SHELLRL_MAX_TURNS": "2",
            "SHELLRL_MAX_NEW_TOKENS": "6",
            "SHELLRL_MAX_ATTEMPTS": "2",
            "SHELLRL_RETRY_BACKOFF_S": "0.2",
            "SHELLRL_EXEC_TIMEOUT_S": "5",
            "SHELLRL_SHUTDOWN_GRACE_S": "3",
        },
        logs,
    )
    start_together([verifier, gateway], 120)
    try:
        client = sync_redis.Redis.from_url(redis_server.url)
        http = httpx.Client(base_url=gateway.url, timeout=30)
        yield {
            "gateway": gateway,
            "sandbox": sandbox,
            "verifier": verifier,
            "engine": engine_process,
            "redis": client,
            "http": http,
        }
        http.close()
        client.close()
    finally:
        gateway.stop()
        verifier.stop()


def _running(process: ServiceProcess) -> bool:
    return process.proc is not None and process.proc.poll() is None


def episodes(redis) -> list:
    return [parse_trajectory(fields[b"pb"]) for _, fields in redis.xrange(STREAM_EPISODES)]


def test_bad_tasks_are_rejected_with_the_field_named(stack):
    http = stack["http"]

    def error(response, status):
        assert response.status_code == status, response.text
        return response.json()["error"]

    assert (
        error(
            http.post(
                "/v1/tasks", content=b"{not json", headers={"content-type": "application/json"}
            ),
            422,
        )["code"]
        == "invalid_json"
    )
    assert (
        error(http.post("/v1/tasks", json={**TASK, "instruction": "x" * 20_000}), 422)["field"]
        == "instruction"
    )
    assert (
        error(
            http.post(
                "/v1/tasks", json={**TASK, "check": {"type": "file_teleported", "path": "a"}}
            ),
            422,
        )["field"]
        == "check.type"
    )
    assert (
        error(http.post("/v1/tasks", json={k: v for k, v in TASK.items() if k != "check"}), 422)[
            "field"
        ]
        == "check"
    )
    assert error(http.post("/v1/tasks", json={**TASK, "colour": "red"}), 422)["field"] == "colour"
    bad_list = [
        dict(TASK, task_id="ok-1", split="eval"),
        dict(TASK, task_id="ok-2", max_turns=1000),
    ]
    assert error(http.post("/v1/tasks", json=bad_list), 422)["field"] == "tasks[1].max_turns"
    assert (
        http.get("/v1/tasks/ok-1").status_code == 404
    )  # all or nothing: the valid first item is not stored
    assert error(http.get("/v1/tasks/nope"), 404)["field"] == "task_id"
    assert (
        error(
            http.post(
                "/v1/tasks",
                content=b"[" + b" " * (33 << 20) + b"]",
                headers={"content-type": "application/json"},
            ),
            413,
        )["code"]
        == "payload_too_large"
    )
    assert (
        error(http.post("/v1/evaluations", json={"split": "eval", "task_ids": ["a"]}), 422)["field"]
        is None
    )
    assert (
        error(http.post("/v1/evaluations", json={"task_ids": ["nope"]}), 422)["field"]
        == "task_ids[0]"
    )


def test_posted_task_becomes_trajectories_scored_into_task_stats_with_bounded_admission(stack):
    """A learner that never advances (version stays 0): exactly (k+1)*B groups are admitted, their
    trajectories carry correct masks and versions, the verifier scores them, and the task reports it."""
    http, redis = stack["http"], stack["redis"]
    created = http.post("/v1/tasks", json=TASK)
    assert created.status_code == 201 and created.json()["task_id"] == "lines-1"
    assert http.post("/v1/tasks", json=TASK).json()["tasks"][0]["status"] == "duplicate"
    conflict = http.post("/v1/tasks", json={**TASK, "instruction": "something else"})
    assert conflict.status_code == 409 and conflict.json()["error"]["field"] == "task_id"
    bound = (MAX_STALENESS + 1) * GROUPS_PER_STEP
    wait_until(
        lambda: len(episodes(redis)) >= bound * GROUP_SIZE, 120, "the admitted groups' trajectories"
    )
    wait_until(
        lambda: (
            (s := http.get("/v1/status").json())["episode_slots_taken"] == GROUP_SIZE
            and s["episodes_in_flight"] == 0
        ),
        60,
        "the next group holding its slots, waiting for admission",
    )
    # the learner never advances: nothing more may be admitted (a bounded look, which can miss a
    # late admission under load but never fails falsely)
    time.sleep(2.0)
    status = http.get("/v1/status").json()
    assert status["admission"]["groups_admitted"] == bound == int(redis.get(ADMITTED_KEY))
    assert status["admission"]["can_admit"] is False and status["pool"]["tasks"] == 1
    trajectories = episodes(redis)
    weight_version = httpx.get(f"{stack['engine'].url}/model_info").json()["weight_version"]
    # the package's engine: a test of another module may have pushed weights to it
    engine_version = 0 if weight_version == "default" else int(weight_version)
    assert (
        len(trajectories) == bound * GROUP_SIZE and len({t.group_id for t in trajectories}) == bound
    )
    for traj in trajectories:
        assert (
            traj.failure == Failure.FAILURE_NONE
            and traj.group_size == GROUP_SIZE
            and traj.attempt == 0
        )
        assert traj.trajectory_id.startswith(traj.group_id) and traj.task.task_id == "lines-1"
        assert traj.sandbox_session_id and traj.admitted_at <= traj.created_at <= traj.finished_at
        arrays = trajectory_arrays(traj)
        mask = [
            s.kind == SegmentKind.SEGMENT_KIND_ACTION
            for s in traj.segments
            for _ in range(len(s.token_ids) // 4)
        ]
        assert arrays.loss_mask.astype(bool).tolist() == mask and arrays.loss_mask.sum() > 0
        assert {
            s.policy_version for s in traj.segments if s.kind == SegmentKind.SEGMENT_KIND_ACTION
        } == {engine_version}
    stats = wait_until(
        lambda: (
            (v := http.get("/v1/tasks/lines-1").json())["episodes"]["scored"] == len(trajectories)
            and v
        ),
        60,
        "the verifier's scores in the task statistics",
    )
    assert stats["episodes"]["started"] == stats["episodes"]["finished"] == len(trajectories)
    assert stats["episodes"]["in_flight"] == 0 and stats["policy_versions"] == {
        str(engine_version): len(trajectories)
    }
    assert stats["rewards"]["mean"] is not None and stats["state"] == "pooled"
    listed = http.get("/v1/tasks", params={"tag": "count", "limit": 10}).json()
    assert [t["task_id"] for t in listed["tasks"]] == ["lines-1"] and listed["next_cursor"] is None
    _open_admission(redis, 1)  # one learner step: one more step's groups, after a staleness wait
    wait_until(
        lambda: (
            http.get("/v1/status").json()["admission"]["groups_admitted"] == bound + GROUPS_PER_STEP
        ),
        60,
        "the next step's groups admitted",
    )
    wait_until(
        lambda: (
            'shellrl_rollout_admission_wait_seconds_count{reason="staleness"}'
            in http.get("/metrics").text
        ),
        30,
        "the time admission waited on staleness, exported",
    )


def test_submit_cli_posts_a_task_file_and_names_the_bad_line(stack, tmp_path):
    good = EVAL_TASKS
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in good) + "\n\n")
    cli = [sys.executable, "-m", "cli.main", "submit", str(path), "--url", stack["gateway"].url]
    first = run_owned(cli, check=False, capture_output=True, text=True, cwd=REPO, timeout_s=60)
    again = run_owned(cli, check=False, capture_output=True, text=True, cwd=REPO, timeout_s=60)
    assert first.returncode == 0 and "3 created, 0 duplicates, 0 errors" in first.stdout, (
        first.stderr
    )
    assert again.returncode == 0 and "0 created, 3 duplicates" in again.stdout
    path.write_text(
        json.dumps(good[0]) + "\n" + json.dumps({**good[1], "check": {"type": "nope"}}) + "\n"
    )
    bad = run_owned(cli, check=False, capture_output=True, text=True, cwd=REPO, timeout_s=60)
    assert bad.returncode == 1 and f"{path}:2: check.type: unknown check type 'nope'" in bad.stderr
    page = stack["http"].get("/v1/tasks", params={"split": "eval", "limit": 2}).json()
    assert [t["task_id"] for t in page["tasks"]] == ["eval-0", "eval-1"] and page["total"] == 3
    rest = (
        stack["http"]
        .get("/v1/tasks", params={"split": "eval", "cursor": page["next_cursor"]})
        .json()
    )
    assert [t["task_id"] for t in rest["tasks"]] == ["eval-2"] and rest["tasks"][0][
        "state"
    ] == "held_out"


def test_evaluation_runs_the_eval_split_greedily_outside_the_training_stream(stack):
    http, redis = stack["http"], stack["redis"]
    assert http.post("/v1/tasks", json=EVAL_TASKS).status_code == 201
    before = redis.xlen(STREAM_EPISODES)
    started = http.post(
        "/v1/evaluations", json={"split": "eval", "episodes_per_task": 1, "max_turns": 1}
    )
    assert started.status_code == 202, started.text
    evaluation_id = started.json()["evaluation_id"]
    done = wait_until(
        lambda: (v := http.get(f"/v1/evaluations/{evaluation_id}").json())["state"] == "done" and v,
        120,
        "the evaluation",
    )
    assert (
        done["episodes_done"] == 3 and done["budget_episodes"] == 3 and done["policy_version"] == 0
    )
    assert done["sampling"]["temperature"] == 0.0 and set(done["per_task"]) == {
        "eval-0",
        "eval-1",
        "eval-2",
    }
    assert done["episodes_scored"] + sum(done["failures"].values()) == 3
    assert done["episodes_scored"] == 3 and done["success_rate"] is not None, (
        done
    )  # verifier and sandbox are up
    assert all(r["trajectory_id"].startswith(evaluation_id) for r in done["results"])
    assert redis.xlen(STREAM_EPISODES) == before  # eval episodes never enter the training stream
    listed = http.get("/v1/evaluations").json()["evaluations"]
    assert listed[0]["evaluation_id"] == evaluation_id and "results" not in listed[0]


def _open_admission(redis, version: int) -> None:
    redis.set(POLICY_VERSION_KEY, version)
    redis.publish(POLICY_UPDATES_CHANNEL, str(version))


def test_sandbox_killed_mid_episode_gives_infra_trajectories_and_the_gateway_stays_up(stack):
    http, redis, sandbox = stack["http"], stack["redis"], stack["sandbox"]
    _open_admission(redis, 1000)  # the learner "jumps ahead": admission runs freely
    assert http.post("/v1/tasks", json=TASK).status_code == 201
    # the first groups' episodes, while they run (not after one finished: the engine's version
    # stays 0, so strict staleness admits (k+1)*B groups only, which run and end together; on a
    # loaded CI machine the others had ended by the time the first was seen)
    wait_until(
        lambda: http.get("/v1/status").json()["episodes_in_flight"] > 0, 120, "episodes in flight"
    )
    before = redis.xlen(STREAM_EPISODES)
    try:
        sandbox.kill()
        failed = wait_until(
            lambda: [
                t for t in episodes(redis)[before:] if t.failure == Failure.FAILURE_INFRA_SANDBOX
            ],
            60,
            "an INFRA_SANDBOX trajectory",
        )
        assert all(t.reward == 0 and not t.scored and t.sandbox_session_id == "" for t in failed)
        assert "sandbox" in failed[0].failure_detail
        wait_until(
            lambda: http.get("/v1/status").json()["infra_down"] == ["sandbox"],
            30,
            "admission gated on the sandbox",
        )
        assert http.get("/healthz").status_code == 200 and http.get("/readyz").status_code == 200
        while_down = dict(TASK, task_id="while-down", split="eval")
        assert http.post("/v1/tasks", json=while_down).status_code == 201
        sandbox.stop()
        sandbox.start(60)  # same port: the gate's probe sees it again and admission resumes
        wait_until(
            lambda: http.get("/v1/status").json()["infra_down"] == [], 30, "admission to resume"
        )
        count = redis.xlen(STREAM_EPISODES)
        wait_until(
            lambda: any(t.failure == Failure.FAILURE_NONE for t in episodes(redis)[count:]),
            60,
            "a successful episode after the sandbox came back",
        )
        metrics = http.get("/metrics").text  # after the kill and a finished episode
        for line in (
            'shellrl_rollout_failures_total{failure="infra_sandbox"}',
            'shellrl_rollout_tokens_total{kind="action"}',
            "shellrl_episodes_in_flight",
            "shellrl_rollout_generate_seconds_count",
            "shellrl_rollout_exec_seconds_count",
            "shellrl_rollout_episodes_by_version_total{policy_version=",
        ):
            assert line in metrics, line
    finally:
        if not _running(sandbox):  # the module's sandbox, back for the tests after this one
            sandbox.stop()
            sandbox.start(60)


def test_engine_killed_mid_episode_gives_infra_trajectories_nothing_lost_gateway_healthy(stack):
    http, redis, engine = stack["http"], stack["redis"], stack["engine"]
    _open_admission(redis, 1000)
    assert http.post("/v1/tasks", json=TASK).status_code == 201
    before = redis.xlen(STREAM_EPISODES)
    wait_until(
        lambda: http.get("/v1/status").json()["episodes_in_flight"] > 0, 120, "episodes in flight"
    )
    try:
        engine.kill()
        failed = wait_until(
            lambda: [
                t for t in episodes(redis)[before:] if t.failure == Failure.FAILURE_INFRA_ENGINE
            ],
            60,
            "an INFRA_ENGINE trajectory",
        )
        assert all(t.reward == 0 and not t.scored and "engine" in t.failure_detail for t in failed)
        wait_until(
            lambda: "engine" in http.get("/v1/status").json()["infra_down"],
            30,
            "admission gated on the engine",
        )
        # nothing lost: every sample that started before the kill is in the stream (retries wait
        # for the engine). Admission is gated, so no group starts after `status`, and a group that
        # leaves flight meanwhile published all its samples first (worker.run_group)
        status = http.get("/v1/status").json()
        by_group: dict[str, set[int]] = {}
        for traj in episodes(redis):
            index = int(traj.trajectory_id.rsplit("-", 2)[1])
            by_group.setdefault(traj.group_id, set()).add(index)
        incomplete = [g for g, s in by_group.items() if s != set(range(GROUP_SIZE))]
        assert len(incomplete) <= status["admission"]["groups_in_flight"]
        assert http.get("/healthz").status_code == 200 and http.get("/readyz").status_code == 200
        task = http.get(f"/v1/tasks/{TASK['task_id']}").json()
        assert task["failures"].get("infra_engine", 0) >= len(failed)
    finally:
        engine.stop()  # the package's engine, back for the tests after this one
        engine.start(ready_timeout_s=180)
