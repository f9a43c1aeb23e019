"""`shellrl eval --tasks FILE` against a real stack: Redis, the package's engine (tiny), a sandbox,
a verifier and the rollout gateway as processes; the command submits the file as eval copies,
evaluates them greedily through POST /v1/evaluations and prints and writes the per-template
results."""

from __future__ import annotations

import json
import shutil

import pytest

from cli.main import main as cli_main
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.service.rollout.conftest import start_sandbox


@pytest.fixture(scope="module")
def gateway(module_redis_server, engine_process, tmp_path_factory):
    logs = tmp_path_factory.mktemp("eval-command-logs")
    sandbox, root = start_sandbox(logs)
    env = {"SHELLRL_REDIS_URL": module_redis_server.url}
    verifier = ServiceProcess(
        "verifier", free_port(), {**env, "SHELLRL_SANDBOX_URL": sandbox.url}, logs
    ).start(120)
    gateway = ServiceProcess(
        "rollout",
        free_port(),
        {
            **env,
            "SHELLRL_ENGINE_URLS": engine_process.url,
            "SHELLRL_SANDBOX_URL": sandbox.url,
            "SHELLRL_VERIFIER_URL": verifier.url,
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_WORKER_ENABLED": "false",
            "SHELLRL_MAX_TURNS": "1",
            "SHELLRL_MAX_NEW_TOKENS": "6",
            "SHELLRL_EXEC_TIMEOUT_S": "5",
        },
        logs,
    ).start(120)
    yield gateway
    for proc in (gateway, verifier, sandbox):
        proc.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_eval_of_a_task_file_prints_success_with_its_interval_and_a_row_per_template(
    gateway, tmp_path, capsys
):
    tasks = [
        {
            "task_id": f"lines-{i}",
            "instruction": "How many lines does numbers.txt have?",
            "setup": "seq 1 5 > numbers.txt",
            "check": {"type": "answer_integer_equals", "expected": 5},
            "template": template,
        }
        for i, template in enumerate(["count_lines", "count_lines", "other"])
    ]
    path, out = tmp_path / "mine.jsonl", tmp_path / "results.json"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    argv = ["eval", "--tasks", str(path), "--url", gateway.url, "--out", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "mine: success" in printed and "count_lines" in printed and "other" in printed
    view = json.loads(out.read_text())["mine"]
    assert view["state"] == "done" and len(view["results"]) == 3
    assert {r["task_id"] for r in view["results"]} == {"lines-0", "lines-1", "lines-2"}
    assert {r["outcome"] for r in view["results"]} <= {"success", "wrong"}  # all scored


def test_eval_with_a_model_path_starts_a_stack_without_a_learner_and_stops_it(
    tmp_path, capsys, monkeypatch
):
    """`shellrl eval --model-path DIR --tasks FILE` (issue 22 item 5): the command starts Redis,
    engine, sandbox, verifier and rollout on the model (free ports here, so no other stack on this
    machine is disturbed), evaluates the file through them and stops every process."""
    from cli import stack_config

    ports = {name: free_port() for name in stack_config.DEFAULT_PORTS}
    monkeypatch.setattr(stack_config, "DEFAULT_PORTS", ports)
    task = {
        "task_id": "lines-0",
        "instruction": "How many lines does numbers.txt have?",
        "setup": "seq 1 5 > numbers.txt",
        "check": {"type": "answer_integer_equals", "expected": 5},
    }
    path, out, state = tmp_path / "one.jsonl", tmp_path / "results.json", tmp_path / "state"
    path.write_text(json.dumps(task) + "\n")
    monkeypatch.setenv("SHELLRL_MAX_NEW_TOKENS", "6")
    monkeypatch.setenv("SHELLRL_MAX_TURNS", "1")
    argv = ["eval", "--model-path", "tiny", "--tasks", str(path), "--state-dir", str(state)]
    assert cli_main([*argv, "--out", str(out)]) == 0
    assert "one: success" in capsys.readouterr().out
    view = json.loads(out.read_text())["one"]
    assert view["state"] == "done" and [r["task_id"] for r in view["results"]] == ["lines-0"]
    assert (state / "logs" / "rollout.log").exists()
    assert not (state / "logs" / "learner.log").exists()
    assert all(stack_config.port_is_free(p) for p in ports.values())  # everything stopped
