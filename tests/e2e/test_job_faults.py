"""The main job when a service dies mid-run (issue 19, Faults): `python -m cli.main run` on the
tiny model starts its real stack, evaluates, and starts training; the test then SIGKILLs the
learner (its pid from <state>/stack.json). The job must stop at its next poll with exit status 1
and one error line naming the learner, its failure class and the phase, stop every process of
the stack, and leave an incomplete report (summary.json with `incomplete`, report.md) of what
ran: the before-evaluation, and the after-evaluation marked not evaluated; `shellrl status`
then names the job's early stop.

Each stack runs at a port offset of its own (tests/helpers/port_offsets.py): with the default
ports it skipped while another stack held them, and a fresh-clone CI beside another failed with
"ports in use: redis:6399" when the other suite's stack took them between the check and the start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

from cli.stack_status import process_alive
from services.learner.checkpoint import surviving_steps
from tests.helpers.owned_processes import popen_owned, run_owned
from tests.helpers.port_offsets import free_port_offsets
from tests.helpers.processes import REPO
from tests.helpers.waiting import wait_until

JOB_FLAGS = (
    "--model-path tiny --steps 50 --time-budget-min 3 --eval-id-episodes 1 "
    "--eval-ood-episodes 1 --agentbench-eval-tasks 1 --max-new-tokens 8 --max-turns 1 "
    "--group-size 2 --groups-per-step 1 --tracker none"
).split()
EVAL_SETS = 4  # eval_id, eval_ood, seeds, agentbench: one "before <set>: success" line each


def test_a_learner_killed_mid_training_stops_the_job_with_its_class_and_an_incomplete_report(
    tmp_path,
):
    (offset,) = free_port_offsets()  # its own ports: another suite may run a stack meanwhile
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)  # the sandbox's workspace root must be traversable by other uids
    err_path = tmp_path / "job.stderr"
    with open(err_path, "w") as err:
        job = popen_owned(
            [sys.executable, "-m", "cli.main", "run", "--state-dir", str(state), *JOB_FLAGS]
            + ["--port-offset", str(offset)],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    out: list[str] = []

    def read_stdout() -> None:
        for line in job.stdout:
            out.append(line)

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    pids: dict[str, int] = {}
    try:
        evaluated = lambda: sum(bool(re.match(r"\s*before\s+\w+: success", ln)) for ln in out)
        wait_until(lambda: evaluated() >= EVAL_SETS or job.poll() is not None, 240, "eval before")
        assert job.poll() is None, "".join(out) + err_path.read_text()
        pids = json.loads((state / "stack.json").read_text())["processes"]
        os.kill(pids["learner"], signal.SIGKILL)  # training starts right after the evaluation
        status = job.wait(120)
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGINT)  # the job stops its stack on Ctrl-C
            job.wait(60)
        reader.join(10)
    stderr = err_path.read_text()
    log = "".join(out) + stderr
    assert status == 1, log
    error = stderr.strip().splitlines()[-1]
    assert error.startswith(
        "shellrl run: error: learner exited with status -9 during train: killed (SIGKILL); see "
    ), log
    assert f"incomplete report in {state}/report" in error
    assert "a rerun without --fresh trains from step 0 again" in error  # no checkpoint yet
    summary = json.loads((state / "report" / "summary.json").read_text())
    assert summary["incomplete"]["service"] == "learner"
    assert summary["incomplete"]["class"] == "killed (SIGKILL)"
    assert summary["incomplete"]["phase"] == "train"
    assert summary["sets"]["eval_id"]["after"] is None and summary["sets"]["eval_id"]["before"]
    assert summary["line"].startswith("incomplete: learner killed (SIGKILL) during train")
    assert "Incomplete run" in (state / "report" / "report.md").read_text()
    assert not (state / "stack.json").exists()  # the stack stopped ...
    assert not [n for n, pid in pids.items() if process_alive(pid)]  # ... every process of it
    shown = run_owned(
        [sys.executable, "-m", "cli.main", "status", "--state-dir", str(state)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout_s=60,
    )
    assert shown.returncode == 1
    assert "the last job stopped early: incomplete: learner killed (SIGKILL)" in shown.stderr


def test_a_learner_oom_stops_the_job_and_the_rerun_evaluates_and_trains_from_its_checkpoint(
    tmp_path,
):
    """The learner's out-of-memory death on CPU (the SHELLRL_FAULT_OOM_AT_STEP drill before step
    3: torch's own allocator error) ends the job as `oom` with the checkpoint to resume from; the
    rerun without --fresh waits until the engine serves the resumed policy, evaluates that one
    (version 2, not the base weights) and trains steps 3 and 4. The same on a GPU:
    tests/gpu/test_gpu_stack.py."""
    (offset,) = free_port_offsets()  # its own ports: another suite may run a stack meanwhile
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    common = (
        "[env]\nSHELLRL_TRAIN_ZERO_VARIANCE_GROUPS = true\nSHELLRL_CHECKPOINT_INTERVAL_STEPS = 1\n"
    )
    drill, plain = tmp_path / "drill.toml", tmp_path / "plain.toml"
    drill.write_text(common + "SHELLRL_FAULT_OOM_AT_STEP = 3\n")
    plain.write_text(common)
    flags = [f for f in JOB_FLAGS if f not in ("--steps", "50")] + ["--steps", "4"]

    def job(config):
        return run_owned(
            [sys.executable, "-m", "cli.main", "run", "--state-dir", str(state)]
            + ["--config", str(config), "--port-offset", str(offset), *flags],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"},
            capture_output=True,
            text=True,
            timeout_s=600,
        )

    first = job(drill)
    log = first.stdout + first.stderr
    assert first.returncode == 1, log
    error = first.stderr.strip().splitlines()[-1]
    assert "learner exited with status -15 during train: oom" in error, log
    assert "can't allocate memory" in error and "resume from step 2" in error, error
    assert (
        json.loads((state / "report" / "summary.json").read_text())["incomplete"]["class"] == "oom"
    )

    second = job(plain)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log
    assert "the learner resumed at step 2; evaluating that policy" in second.stdout, log
    evaluations = json.loads((state / "report" / "evaluations.json").read_text())
    assert evaluations["before"]["eval_id"]["policy_versions_seen"] == [2], evaluations["before"]
    ledger = [
        json.loads(x) for x in (state / "checkpoints" / "steps.jsonl").read_text().splitlines()
    ]
    assert {"event": "resume", "step": 2, "checkpoint": "step-000002"} in ledger
    assert sorted(surviving_steps(ledger)) == [1, 2, 3, 4], ledger  # --steps 4, not a step past
