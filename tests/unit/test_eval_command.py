"""`shellrl eval`'s parts that need no stack (cli/commands/eval.py): which tasks it evaluates and
the per-template table it prints from an evaluation view shaped as GET /v1/evaluations/{id}."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from cli.commands import eval as eval_command
from cli.errors import CliError
from shellrl.contract import task_from_json


def task(task_id: str, template: str):
    return task_from_json(
        {
            "task_id": task_id,
            "instruction": "How many lines?",
            "check": {"type": "answer_integer_equals", "expected": 5},
            "template": template,
            "split": "eval",
        }
    )


def result(task_id: str, outcome: str) -> dict:
    reward = {"success": 1.0, "wrong": 0.0}.get(outcome)
    return {"task_id": task_id, "outcome": outcome, "reward": reward}


def test_a_task_file_is_one_set_named_after_it_and_a_bad_one_is_a_cli_error(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"instruction": "pwd?", "check": {"type": "answer_equals", "expected": "/"}})
        + "\n"
    )
    assert list(eval_command.load_sets("", path)) == ["mine"]
    assert eval_command.load_sets("", path)["mine"][0].instruction == "pwd?"
    path.write_text("{not json\n")
    with pytest.raises(CliError, match="mine.jsonl"):
        eval_command.load_sets("", path)
    with pytest.raises(CliError, match="unknown set"):
        eval_command.load_sets("eval_id,nope", None)


def test_templates_average_task_pass_rates_and_infra_failures_count_nowhere():
    tasks = {"a1": task("a1", "count"), "a2": task("a2", "count"), "b1": task("b1", "find")}
    view = {
        "results": [
            result("a1", "success"),
            result("a1", "wrong"),
            result("a2", "success"),
            result("a2", "success"),
            result("b1", "infra_engine"),
            result("b1", "wrong"),
        ],
        "policy_versions_seen": [7],
    }
    assert eval_command.template_rows(view, tasks) == [
        ("count", 2, 3, 4, 0.75),
        ("find", 1, 0, 1, 0.0),
    ]
    console = Console(width=140, record=True)
    console.print(eval_command.render("eval_id", view, tasks))
    text = console.export_text()
    assert "eval_id: success" in text and "n=3 tasks, 5 episodes" in text and "count" in text


def test_eval_with_a_model_path_never_deletes_a_training_runs_state_directory(tmp_path, capsys):
    from cli.main import main as cli_main

    step = tmp_path / "state" / "checkpoints" / "step-000001"
    step.mkdir(parents=True)
    tasks = tmp_path / "one.jsonl"
    tasks.write_text(
        json.dumps({"instruction": "x", "check": {"type": "answer_equals", "expected": "1"}}) + "\n"
    )
    argv = [
        "eval",
        "--model-path",
        "tiny",
        "--tasks",
        str(tasks),
        "--state-dir",
        str(step.parents[1]),
    ]
    assert cli_main(argv) == 2
    assert "holds a training run's checkpoints" in capsys.readouterr().err
    assert step.is_dir()  # nothing deleted, nothing started
