"""Training a running stack (issue 22 item 3) and eval transcripts: a whole stack of real
processes (Redis, an engine and a learner on the tiny model, sandbox, verifier, rollout gateway,
bearer token on) that nothing in the test starts training on until `POST /v1/runs` does; then
`shellrl run --attach URL` drives the main job's phases against it. The stack is the module's
(its learner is slow to start); each test finds it as a fresh one is (`stack`: the learner taking
steps, no run training) and submits the tasks it needs.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import redis as sync_redis

from cli.main import main as cli_main
from shellrl.streams.keys import POOL_KEY
from tests.helpers.processes import ServiceProcess, start_together
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until
from tests.service.rollout.conftest import sandbox_service

pytestmark = pytest.mark.slow  # a whole stack of processes (~40-110 s to start on 2 cores)
TOKEN = "training-runs-test-token-0123456789abcdef"
TINY = {"SHELLRL_MODEL_PATH": "tiny", "SHELLRL_NUM_THREADS": "1", "SHELLRL_API_TOKEN": TOKEN}
RL = {"SHELLRL_GROUP_SIZE": "2", "SHELLRL_GROUPS_PER_STEP": "1", "SHELLRL_MAX_STALENESS": "1"}


def task(i: int, **fields) -> dict:
    return {
        "task_id": f"run-task-{i}",
        "instruction": "How many lines does numbers.txt have?",
        "setup": "seq 1 5 > numbers.txt",
        "check": {"type": "answer_integer_equals", "expected": 5},
        "template": "count_lines",
        **fields,
    }


@pytest.fixture(scope="module")
def module_stack(module_redis_server, tmp_path_factory):
    logs, tmp = tmp_path_factory.mktemp("runs-logs"), tmp_path_factory.mktemp("runs")
    task_dir = tmp / "tasks"
    task_dir.mkdir()
    (task_dir / "train.jsonl").write_text("".join(json.dumps(task(i)) + "\n" for i in range(2)))
    env = {"SHELLRL_REDIS_URL": module_redis_server.url, "SHELLRL_API_TOKEN": TOKEN}
    engine = ServiceProcess("engine", free_port(), TINY, logs)
    sandbox, root = sandbox_service(logs, {"SHELLRL_API_TOKEN": TOKEN})
    verifier = ServiceProcess(
        "verifier",
        free_port(),
        {**env, "SHELLRL_SANDBOX_URL": sandbox.url, "SHELLRL_REQUIRE_COMMAND": "true"},
        logs,
    )
    gateway = ServiceProcess(
        "rollout",
        free_port(),
        {
            **env,
            **RL,
            "SHELLRL_ENGINE_URLS": engine.url,
            "SHELLRL_SANDBOX_URL": sandbox.url,
            "SHELLRL_VERIFIER_URL": verifier.url,
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_MAX_TURNS": "1",
            "SHELLRL_MAX_NEW_TOKENS": "6",
            "SHELLRL_EXEC_TIMEOUT_S": "5",
            "SHELLRL_TASK_FILE_DIR": str(task_dir),
        },
        logs,
    )
    learner = ServiceProcess(
        "learner",
        free_port(),
        {
            **env,
            **TINY,
            **RL,
            "SHELLRL_ENGINE_URLS": engine.url,
            "SHELLRL_CHECKPOINT_DIR": str(tmp / "ckpt"),
            "SHELLRL_WEIGHT_SYNC_DIR": str(tmp / "sync"),
            "SHELLRL_CHECKPOINT_INTERVAL_STEPS": "100",
            "SHELLRL_BLOCK_MS": "200",
            # the random tiny model never succeeds: train on zero-variance groups too
            "SHELLRL_TRAIN_ZERO_VARIANCE_GROUPS": "true",
        },
        logs,
    )
    procs = [engine, sandbox, verifier, gateway, learner]
    try:
        start_together(procs, 180)  # each waits for what it needs to be ready
        yield {"gateway": gateway, "learner": learner, "verifier": verifier, "redis": env}
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def stack(module_stack):
    """The module's stack as a test alone finds it: no run training (a failed test may leave one)
    and the learner taking steps (an attached job pauses it at its end)."""
    for run in api(module_stack, "GET", "/v1/runs").json()["runs"]:
        if run["state"] == "training":
            api(module_stack, "POST", f"/v1/runs/{run['run_id']}/stop").raise_for_status()
    httpx.post(
        f"{module_stack['learner'].url}/v1/resume",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    ).raise_for_status()
    return module_stack


def api(stack, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(
        method,
        f"{stack['gateway'].url}{path}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
        **kwargs,
    )


def error_field(response: httpx.Response, status: int) -> str | None:
    assert response.status_code == status, response.text
    return response.json()["error"]["field"]


def test_bad_run_bodies_are_refused_naming_the_field(stack):
    assert error_field(api(stack, "POST", "/v1/runs", json={"tasks": [task(0)]}), 422) == "steps"
    both = {"tasks": [task(0)], "task_file": "train.jsonl", "steps": 1}
    assert api(stack, "POST", "/v1/runs", json=both).status_code == 422
    bad_check = {"tasks": [task(0), task(1, check={"type": "nope"})], "steps": 1}
    assert error_field(api(stack, "POST", "/v1/runs", json=bad_check), 422).startswith("tasks[1].")
    eval_split = {"tasks": [task(0, split="eval_id")], "steps": 1}
    assert error_field(api(stack, "POST", "/v1/runs", json=eval_split), 422) == "tasks[0].split"
    outside = {"task_file": "../runs-logs/x.jsonl", "steps": 1}
    assert error_field(api(stack, "POST", "/v1/runs", json=outside), 422) == "task_file"
    missing = {"task_file": "none.jsonl", "steps": 1}
    assert error_field(api(stack, "POST", "/v1/runs", json=missing), 422) == "task_file"
    assert error_field(api(stack, "GET", "/v1/runs/run-nope"), 404) == "run_id"
    assert httpx.get(f"{stack['gateway'].url}/v1/runs", timeout=10).status_code == 401


def test_run_of_a_task_file_trains_its_steps_then_its_tasks_leave_the_pool(stack):
    r = api(stack, "POST", "/v1/runs", json={"task_file": "train.jsonl", "steps": 1})
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["state"] == "training" and run["tasks"] == 2 and run["steps"] == 1
    assert run["submitted"]["created"] == 2
    assert run["target_policy_version"] == run["start_policy_version"] + 1
    again = api(stack, "POST", "/v1/runs", json={"tasks": [task(5)], "steps": 1})
    assert error_field(again, 409) == "run"

    def ended():
        view = api(stack, "GET", f"/v1/runs/{run['run_id']}").json()
        return view if view["state"] != "training" else None

    view = wait_until(ended, 120, "the run to reach its step", poll_s=1.0)
    assert view["state"] == "done" and view["steps_done"] == 1 and view["progress"] == 1.0
    assert view["groups_admitted"] >= 1
    # The step that ends the run may train a group of an earlier test of this module (random order,
    # seed 13: `done` with the run's own group admitted and none of its episodes finished), so the
    # run's own group may finish after `done`: in-flight groups finish and are counted (runs.py).

    def own_group_finished():
        v = api(stack, "GET", f"/v1/runs/{run['run_id']}").json()
        return v if v["episodes"]["finished"] >= 2 else None

    view = wait_until(own_group_finished, 120, "the run's own group to finish", poll_s=1.0)
    assert view["policy_version"] >= view["target_policy_version"]
    r = sync_redis.Redis.from_url(stack["redis"]["SHELLRL_REDIS_URL"])
    assert not r.sismember(POOL_KEY, "run-task-0") and not r.sismember(POOL_KEY, "run-task-1")
    assert api(stack, "GET", "/v1/tasks/run-task-0").json()["state"] == "retired"
    listed = api(stack, "GET", "/v1/runs").json()["runs"]
    assert listed[0]["run_id"] == run["run_id"]


def test_a_stopped_run_ends_at_once_and_a_new_run_puts_known_tasks_back(stack):
    known = api(stack, "POST", "/v1/runs", json={"tasks": [task(6)], "steps": 1000}).json()
    assert api(stack, "POST", f"/v1/runs/{known['run_id']}/stop").json()["state"] == "stopped"
    assert api(stack, "GET", "/v1/tasks/run-task-6").json()["state"] == "retired"
    body = {"tasks": [task(6), task(7)], "steps": 1000, "name": "long"}
    r = api(stack, "POST", "/v1/runs", json=body)
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["submitted"] == {"created": 1, "duplicates": 1, "repooled": 1}
    other = {"tasks": [task(8), task(6, instruction="Something else.")], "steps": 1}
    assert error_field(api(stack, "POST", "/v1/runs", json=other), 409) == "run"
    stopped = api(stack, "POST", f"/v1/runs/{run['run_id']}/stop").json()
    assert stopped["state"] == "stopped" and stopped["name"] == "long"
    assert api(stack, "GET", "/v1/tasks/run-task-7").json()["state"] == "retired"
    conflict = api(stack, "POST", "/v1/runs", json=other)  # run-task-6 holds other content
    assert error_field(conflict, 409) == "tasks[1].task_id"
    assert api(stack, "GET", "/v1/tasks/run-task-8").status_code == 404  # nothing stored


def test_eval_trajectories_are_stored_and_shown_by_id(stack, capsys, monkeypatch):
    monkeypatch.setenv("SHELLRL_API_TOKEN", TOKEN)
    r = api(stack, "POST", "/v1/tasks", json=task(9, task_id="eval-lines", split="eval_id"))
    assert r.status_code == 201, r.text
    r = api(stack, "POST", "/v1/evaluations", json={"task_ids": ["eval-lines"]})
    evaluation_id = r.json()["evaluation_id"]

    def done():
        view = api(stack, "GET", f"/v1/evaluations/{evaluation_id}").json()
        return view if view["state"] == "done" else None

    result = wait_until(done, 60, "the evaluation", poll_s=0.5)["results"][0]
    shown = api(stack, "GET", f"/v1/trajectories/{result['trajectory_id']}")
    assert shown.status_code == 200, shown.text
    view = shown.json()
    assert view["eval"] and view["evaluation_id"] == evaluation_id
    assert view["task_id"] == "eval-lines" and view["stream"] == "shellrl:evaluations"
    assert view["reward"] == result["reward"] and view["scored"] == (result["reward"] is not None)
    argv = ["show", result["trajectory_id"], "--url", stack["gateway"].url]
    assert cli_main(argv) == 0
    assert result["trajectory_id"] in capsys.readouterr().out


def test_run_attach_evaluates_trains_and_reports_on_the_running_stack(stack, tmp_path, monkeypatch):
    monkeypatch.setenv("SHELLRL_API_TOKEN", TOKEN)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(task(i)) + "\n" for i in (20, 21)))
    argv = [
        "run",
        "--attach",
        stack["gateway"].url,
        "--learner-url",
        stack["learner"].url,
        "--verifier-url",
        stack["verifier"].url,
        "--steps",
        "1",
        "--train-set",
        str(train),
        "--eval-id-episodes",
        "1",
        "--eval-ood-episodes",
        "1",
        "--agentbench-eval-tasks",
        "1",
        "--tracker",
        "none",
        "--state-dir",
        str(tmp_path / "state"),
    ]
    assert cli_main(argv) == 0
    report = tmp_path / "state" / "report"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["steps"] >= 1 and "line" in summary
    assert (report / "report.md").exists() and (report / "metrics_learner.prom").exists()
    runs = api(stack, "GET", "/v1/runs").json()["runs"]
    assert runs[0]["state"] == "done" and runs[0]["tasks"] == 2
    learner = httpx.get(
        f"{stack['learner'].url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()
    assert learner["paused"] is True  # the "after" evaluation ran on one policy version
    # --steps 1 ends at the run's target: the second group in flight when the run was done
    # does not train a step more (issue 34)
    assert learner["step"] == runs[0]["target_policy_version"] == learner["step_target"]
