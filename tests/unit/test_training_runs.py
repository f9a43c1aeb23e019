"""Pure parts of training a running stack: the body and task-file checks of POST /v1/runs
(services/rollout/run_routes.py) and the attached job's helpers (cli/attached_job.py)."""

from __future__ import annotations

import json

import pytest

from cli.attached_job import default_learner_url, steps_seen
from services.rollout.run_routes import parse_run, read_task_file
from shellrl.service.app import ApiError


def field_of(call) -> str | None:
    with pytest.raises(ApiError) as exc:
        call()
    assert exc.value.status == 422
    return exc.value.field


def test_a_run_body_needs_steps_and_exactly_one_source():
    assert parse_run({"tasks": [{}], "steps": 2}).steps == 2
    assert field_of(lambda: parse_run({"tasks": [{}]})) == "steps"
    assert field_of(lambda: parse_run({"tasks": [{}], "steps": 0})) == "steps"
    assert field_of(lambda: parse_run({"tasks": [], "steps": 1})) == "tasks"
    assert field_of(lambda: parse_run({"steps": 1})) is None  # neither source: the body
    assert field_of(lambda: parse_run({"tasks": [{}], "steps": 1, "lr": 1})) == "lr"
    assert field_of(lambda: parse_run([1, 2])) is None


def test_a_task_file_is_read_only_inside_the_task_file_directory(tmp_path):
    task = {"instruction": "x", "check": {"type": "answer_equals", "expected": "y"}}
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "ok.jsonl").write_text(json.dumps(task) + "\n")
    (tmp_path / "secret.jsonl").write_text(json.dumps(task) + "\n")
    (tmp_path / "sets" / "eval.jsonl").write_text(json.dumps({**task, "split": "eval"}) + "\n")
    (tmp_path / "sets" / "bad.jsonl").write_text("{}\n")
    sets = str(tmp_path / "sets")
    assert len(read_task_file(sets, "ok.jsonl")) == 1
    for name in ("../secret.jsonl", str(tmp_path / "secret.jsonl"), "missing.jsonl", "a\x00b"):
        assert field_of(lambda n=name: read_task_file(sets, n)) == "task_file"
    assert field_of(lambda: read_task_file(sets, "eval.jsonl")) == "task_file"
    assert field_of(lambda: read_task_file(sets, "bad.jsonl")) == "task_file"
    assert field_of(lambda: read_task_file(None, "ok.jsonl")) == "task_file"


def test_the_learner_defaults_to_the_gateways_host_and_steps_are_seen_once_each():
    assert default_learner_url("http://10.0.0.5:8100/") == "http://10.0.0.5:8103"
    snaps = [
        {"learner": {"last_step": {"step": 1, "reward_mean": 0.1}}},
        {"learner": {"last_step": {"step": 1, "reward_mean": 0.1}}},
        {"learner": None},
        {"learner": {"last_step": {"step": 3}}},
    ]
    assert [s["step"] for s in steps_seen(snaps)] == [1, 3]
