"""Task JSON form -> validated Task: clear field errors, and the shared task files load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shellrl.contract import (
    Split,
    Task,
    TaskValidationError,
    check_from_json,
    iter_tasks_jsonl,
    task_from_json,
    task_to_json,
)

REPO = Path(__file__).resolve().parents[2]
VALID = {
    "task_id": "count-logs-1",
    "instruction": "How many .log files are in logs/?",
    "setup": "mkdir logs && touch logs/a.log logs/b.log",
    "env": {"HOME": "<workspace>"},
    "check": {"type": "answer_integer_equals", "expected": 2},
    "split": "train",
    "tags": ["answer", "integer"],
    "max_turns": 8,
    "source": "hand-written",
}


def _shared_tasks_file() -> Path | None:
    """The AgentBench OS task file: shipped in the package, else beside the checkout (CI lays
    shared/ next to the clone)."""
    for candidate in (
        REPO / "shellrl" / "tasks" / "data" / "agentbench_os.jsonl",
        REPO.parent / "shared" / "tasks" / "agentbench_os.jsonl",
        Path("/work/shared/tasks/agentbench_os.jsonl"),
    ):
        if candidate.is_file():
            return candidate
    return None


def _error(obj) -> TaskValidationError:
    with pytest.raises(TaskValidationError) as info:
        task_from_json(obj)
    return info.value


def test_valid_task_json_becomes_a_task():
    task = task_from_json(VALID)
    assert isinstance(task, Task)
    assert (
        task.task_id == "count-logs-1" and task.split == Split.SPLIT_TRAIN and task.max_turns == 8
    )
    assert task.checks[0].answer_integer_equals.expected == 2
    assert dict(task.env) == {"HOME": "<workspace>"}


def test_task_json_round_trips_through_the_proto():
    task = task_from_json(
        {
            **VALID,
            "check": [
                {"type": "file_contains", "path": "out.txt", "regex": "^ok$", "timeout_s": 5},
                {"type": "answer_equals", "expected": "2"},
            ],
        }
    )
    again = task_from_json(task_to_json(task))
    assert again == task
    assert task_to_json(task)["check"][0] == {
        "type": "file_contains",
        "path": "out.txt",
        "regex": "^ok$",
        "timeout_s": 5.0,
    }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"instruction": ""}, "instruction"),
        ({"instruction": 5}, "instruction"),
        ({"setup": "echo \x00"}, "setup"),
        ({"task_id": "../etc/passwd"}, "task_id"),
        ({"check": None}, "check"),
        ({"check": []}, "check"),
        ({"check": {"type": "answer_is_right"}}, "check.type"),
        ({"check": {"type": "answer_equals"}}, "check.expected"),
        ({"check": {"type": "answer_equals", "expected": "4", "expectd": "4"}}, "check.expectd"),
        ({"check": {"type": "answer_integer_equals", "expected": "four"}}, "check.expected"),
        ({"check": {"type": "answer_matches", "pattern": "("}}, "check.pattern"),
        ({"check": {"type": "file_exists", "path": "/etc/passwd"}}, "check.path"),
        ({"check": {"type": "file_sha256", "path": "a", "sha256": "XYZ"}}, "check.sha256"),
        ({"check": {"type": "file_contains", "path": "a"}}, "check.substring"),
        ({"check": {"type": "command_output_equals", "command": "ls"}}, "check.expected"),
        (
            {"check": {"type": "answer_equals", "expected": "4", "timeout_s": "soon"}},
            "check.timeout_s",
        ),
        ({"check": {"type": "answer_equals", "expected": "4", "timeout_s": -1}}, "check.timeout_s"),
        (
            {"check": [{"type": "answer_equals", "expected": "4"}, {"type": "file_exists"}]},
            "check[1].path",
        ),
        ({"env": {"1BAD": "x"}}, "env.1BAD"),
        ({"env": {"HOME": 3}}, "env"),
        ({"tags": "answer"}, "tags"),
        ({"max_turns": 1000}, "max_turns"),
        ({"max_turns": True}, "max_turns"),
        ({"split": "validation"}, "split"),
        ({"split": 3}, "split"),
        ({"instructions": "typo"}, "instructions"),
    ],
)
def test_invalid_task_json_names_the_offending_field(change, field):
    err = _error({**VALID, **change})
    assert err.field == field, err
    assert err.message


def test_task_must_be_an_object():
    assert _error(["not", "a", "task"]).field == "task"


def test_check_timeout_given_as_text_is_a_field_error_not_a_crash():
    with pytest.raises(TaskValidationError) as info:
        check_from_json({"type": "command_exit_code", "command": "true", "timeout_s": "5s"})
    assert info.value.field == "check.timeout_s"


def test_jsonl_errors_name_the_line_and_the_field():
    lines = [json.dumps(VALID), "", json.dumps({**VALID, "max_turns": -1})]
    with pytest.raises(TaskValidationError) as info:
        list(iter_tasks_jsonl(lines))
    assert info.value.field == "line 3: max_turns"
    with pytest.raises(TaskValidationError) as info:
        list(iter_tasks_jsonl(["{not json"]))
    assert info.value.field == "line 1" and "invalid JSON" in info.value.message


def test_the_110_agentbench_os_tasks_load():
    path = _shared_tasks_file()
    if path is None:
        pytest.skip("shared/tasks/agentbench_os.jsonl is not beside this checkout")
    tasks = list(iter_tasks_jsonl(path.read_text().splitlines()))
    assert len(tasks) == 110
    assert len({t.task_id for t in tasks}) == 110
    assert all(t.split == Split.SPLIT_TRAIN for t in tasks)
    kinds = {t.checks[0].WhichOneof("kind") for t in tasks}
    assert kinds == {"answer_integer_equals", "answer_equals"}
    assert all(
        t.reference_solution and t.source == "THUDM/AgentBench:os_interaction" for t in tasks
    )
