"""Plug-ins (issue 22 item 6): the example package in examples/shellrl-plugin-example is
pip-installed (offline: no deps, no build isolation, no index) into a temporary target, and
processes that see it on their PYTHONPATH use each kind: its task source through
`load_taskset` and the CLI's task loading, its check type through the task contract (validation
naming the field) and a real verifier's `POST /v1/verify` (an answer check and a workspace check
reading a file of a real sandbox session), and its reward component in the verifier's
`reward_components` and `training_reward`. This test process itself never imports the plug-in,
so no other test sees it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import httpx
import pytest

from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO, ServiceProcess
from tests.helpers.redis_server import free_port

EXAMPLE = REPO / "examples" / "shellrl-plugin-example"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A directory holding the installed example package (its dist-info names the entry points)."""
    tmp = tmp_path_factory.mktemp("plugin")
    source, target = tmp / "src", tmp / "site"
    shutil.copytree(EXAMPLE, source)  # the build writes build/ and *.egg-info next to the source
    run_owned(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout_s=300,
    )
    assert list(target.glob("shellrl_plugin_example-*.dist-info"))
    return str(target)


def python_env(plugin_path: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([plugin_path, str(REPO)])}


def run_python(plugin_path: str, code: str) -> dict:
    """Run `code` (which prints one JSON line last) with the plug-in importable; its output."""
    done = run_owned(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=python_env(plugin_path),
        capture_output=True,
        text=True,
        timeout_s=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_task_source_and_the_check_type_reach_the_task_contract(plugin_path):
    out = run_python(
        plugin_path,
        """
import json
from cli.job_tasks import train_tasks
from cli.job_config import JobConfig
from shellrl.contract import TaskValidationError, task_from_json, task_to_json
from tasksets import load_taskset
train = load_taskset("palindromes", "train", seed=3)
job = train_tasks(JobConfig(train_set="palindromes"))
bad = {"instruction": "x", "check": {"type": "answer_is_palindrome", "min_length": 0}}
try:
    task_from_json(bad)
    field = None
except TaskValidationError as exc:
    field = exc.field
print(json.dumps({
    "train": len(train), "eval": len(load_taskset("palindromes", "eval_id")),
    "job": len(job), "check": task_to_json(train[0])["check"], "bad_field": field,
    "same": task_from_json(task_to_json(train[0])) == train[0],
}))
""",
    )
    assert out["train"] == 6 and out["eval"] == 2 and out["job"] == 6
    assert out["check"] == [{"type": "answer_is_palindrome", "min_length": 5}]
    assert out["bad_field"] == "check.min_length" and out["same"] is True


def test_without_the_plugin_its_check_type_is_unknown():
    from shellrl.contract import TaskValidationError, task_from_json

    with pytest.raises(TaskValidationError) as exc:
        task_from_json({"instruction": "x", "check": {"type": "answer_is_palindrome"}})
    assert exc.value.field == "check.type"


@pytest.fixture(scope="module")
def verifier(plugin_path, sandbox_services, tmp_path_factory):
    sandbox = sandbox_services.get("bubblewrap")
    proc = ServiceProcess(
        "verifier",
        free_port(),
        {
            "PYTHONPATH": python_env(plugin_path)["PYTHONPATH"],
            "SHELLRL_SANDBOX_URL": sandbox.url,
            "SHELLRL_WORKER_ENABLED": "false",
        },
        tmp_path_factory.mktemp("verifier-logs"),
    ).start(120)
    yield proc, sandbox.url
    proc.stop()


def test_the_verifier_runs_plugin_checks_and_reports_the_plugin_reward(verifier):
    proc, sandbox_url = verifier
    http = httpx.Client(base_url=proc.url, timeout=60)
    sid = httpx.post(f"{sandbox_url}/v1/sessions", json={"setup": "seq 1 3 > out.txt"}, timeout=60)
    assert sid.status_code in (200, 201), sid.text
    session_id = sid.json()["session_id"]
    task = {
        "instruction": "Answer with a palindrome.",
        "check": [
            {"type": "answer_is_palindrome", "min_length": 3},
            {"type": "file_line_count", "path": "out.txt", "lines": 3},
        ],
    }
    body = {"task": task, "answer": "Level", "session_id": session_id, "release_session": True}
    result = http.post("/v1/verify", json=body).json()
    assert result["failure"] is None, result
    assert [(c["type"], c["passed"]) for c in result["checks"]] == [
        ("answer_is_palindrome", True),
        ("file_line_count", True),
    ]
    assert result["reward"] == 1.0
    assert result["reward_components"]["few_commands"] == pytest.approx(0.1)
    assert result["training_reward"] == pytest.approx(1.05)  # + weight 0.5 * 0.1
    wrong = http.post("/v1/verify", json={"task": task, "answer": "abc"}).json()
    assert wrong["failure"] == "infra_verifier"  # file_line_count without a session cannot run
    answer_only = {"instruction": "x", "check": {"type": "answer_is_palindrome"}}
    wrong = http.post("/v1/verify", json={"task": answer_only, "answer": "abc"}).json()
    assert wrong["reward"] == 0.0 and wrong["checks"][0]["detail"] == "'abc' is not"
    assert wrong["reward_components"]["few_commands"] == 0.0
    listed = http.get("/v1/checks").json()["checks"]
    assert {c["type"]: c["source"] for c in listed}["file_exists"] == "shellrl"
    plugins = {c["type"]: c for c in listed if c["source"] != "shellrl"}
    assert set(plugins) == {"answer_is_palindrome", "file_line_count"}
    palindrome = plugins["answer_is_palindrome"]
    assert (palindrome["source"], palindrome["version"]) == ("shellrl-plugin-example", "0.1.0")
    assert palindrome["entry_point"] == "shellrl_plugin_example.checks:AnswerIsPalindrome"
    assert palindrome["parameters"]["min_length"] == "int = 1"
    assert "timeout_s" in palindrome["parameters"] and palindrome["description"].startswith("An ")
    refused = http.post(
        "/v1/verify",
        json={"task": {**answer_only, "check": {"type": "answer_is_palindrome", "x": 1}}},
    )
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "task.check.x"
