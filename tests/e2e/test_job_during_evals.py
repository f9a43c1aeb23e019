"""Evaluations during training (issue 33 item 1): `python -m cli.main run` on the tiny model with
`--steps 2 --eval-every-steps 1` evaluates eval_id and eval_ood before training, at step 1 (the
learner paused there, its weights served) and after step 2, so summary.json gives every eval
template three points, at steps 0, 1 and 2, and evaluations.json keeps the one in between. Its
steps train (zero-variance groups too: the tiny model rarely solves one), so every step record
in steps.json carries the KL to the initial policy per training template, and report.md its table.
With --eval-kl the paused learner scores the eval episodes at steps 1 and 2 (POST /v1/kl):
summary.json's eval_kl has the KL per eval template at both.

The stack takes ports moved by --port-offset, clear of a stack of the default ports.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers.owned_processes import run_owned
from tests.helpers.port_offsets import free_port_offsets
from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow

JOB_FLAGS = (
    "--model-path tiny --steps 2 --eval-every-steps 1 --eval-kl --time-budget-min 5 "
    "--eval-id-episodes 2 --eval-ood-episodes 1 --agentbench-eval-tasks 1 --max-new-tokens 8 "
    "--max-turns 1 --group-size 2 --groups-per-step 1 --tracker none"
).split()


def test_a_job_evaluating_during_training_gives_every_template_three_points(tmp_path):
    (offset,) = free_port_offsets()
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)  # the sandbox's workspace root must be traversable by other uids
    config = tmp_path / "job.toml"
    config.write_text("[env]\nSHELLRL_TRAIN_ZERO_VARIANCE_GROUPS = true\n")
    job = run_owned(
        [sys.executable, "-m", "cli.main", "run", "--state-dir", str(state)]
        + ["--config", str(config), *JOB_FLAGS, "--port-offset", str(offset)],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout_s=900,
    )
    log = job.stdout + job.stderr
    assert job.returncode == 0, log
    assert "at step 1" in log, log
    report = state / "report"
    during = json.loads((report / "evaluations.json").read_text())["during"]
    assert len(during) == 1 and set(during[0]) == {"eval_id", "eval_ood"}
    assert max(during[0]["eval_id"]["policy_versions_seen"]) == 1
    templates = json.loads((report / "summary.json").read_text())["templates"]
    assert set(templates) >= {"eval_id", "eval_ood"}
    for name in ("eval_id", "eval_ood"):
        for template, entry in templates[name].items():
            assert [p["step"] for p in entry["trajectory"]] == [0, 1, 2], (name, template, entry)
    steps = json.loads((report / "steps.json").read_text())
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["trajectories"] == 2 and s["kl_by_template"], s
        for entry in s["kl_by_template"].values():
            assert entry["kl"] >= 0 and entry["tokens"] > 0 and entry["trajectories"] == 2
    assert all(e["kl"] < 1e-3 for e in steps[0]["kl_by_template"].values())  # policy = ref
    text = (report / "report.md").read_text()
    assert "| count_lines | 0: 0/1, 1: " in text or "solved by step" in text
    assert "KL to the initial policy per training template" in text and "Not recorded" not in text
    eval_kl = json.loads((report / "summary.json").read_text())["eval_kl"]
    assert [p["step"] for p in eval_kl] == [1, 2], eval_kl
    for point in eval_kl:
        assert point["missing"] == 0 and set(point) >= {"eval_id", "eval_ood"}
        for name in ("eval_id", "eval_ood"):
            assert set(point[name]) == set(templates[name]), (point, templates[name])
            for entry in point[name].values():
                assert entry["kl"] >= 0 and entry["tokens"] > 0 and entry["episodes"] >= 1
    assert "KL to the initial policy on the eval episodes" in text
