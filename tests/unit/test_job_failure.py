"""A service that dies while the main job runs (issue 19, Faults): its failure class, the job's
one-line error, the report written from what ran (the after-evaluation, or both, missing), and
`shellrl status` naming a process that exited with its log's last error."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from cli.job_config import JobConfig
from cli.job_failure import current_phase, failure_message, resume_hint, resume_step
from cli.job_report import JobOutcome, write_job_report
from cli.run_summary import summary_line
from cli.stack_failure import ServiceExited, failure_class, last_error_line
from cli.stack_status import down_causes, exited_processes
from tasksets.generator import generate
from tests.helpers.owned_processes import popen_owned, run_owned
from tests.helpers.processes import REPO
from tests.helpers.redis_server import free_port
from tests.unit.test_eval_stats import view

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.mark.parametrize(
    ("status", "cause", "expected"),
    [
        (-9, None, "killed (SIGKILL)"),
        (-9, OOM, "killed (SIGKILL)"),  # the kernel's OOM killer or a person, not the log line
        (-15, OOM, "oom"),  # e.g. the learner's SIGTERM to itself after its worker died
        (-15, "ValueError: stale", "killed (SIGTERM)"),
        (-6, None, "killed (SIGABRT)"),
        (1, OOM, "oom"),
        (1, "learner step failed: RuntimeError: CUBLAS_STATUS_ALLOC_FAILED", "oom"),
        (1, "MemoryError", "oom"),
        (1, "ValueError: bad config", "crash"),
        (1, "engine loop failed: torch.distributed.DistBackendError: NCCL error", "crash"),
        (0, '{"level": "INFO", "msg": "shutting down"}', "exited"),
        (None, None, "exited"),
    ],
)
def test_a_dead_service_is_classified_by_its_signal_or_its_last_error(status, cause, expected):
    assert failure_class(status, cause) == expected


def test_the_oom_drill_on_cpu_raises_torchs_allocator_error_which_classifies_as_oom(tmp_path):
    # the learner's SHELLRL_FAULT_OOM_AT_STEP drill on a CPU learner: torch's real allocator error,
    # logged as the learner logs a dead worker (a JSON ERROR record with the traceback), was
    # classified "crash" before "can't allocate memory" counted as out of memory
    torch = pytest.importorskip("torch")
    from services.learner.worker import allocate_past_device_memory

    with pytest.raises(RuntimeError) as raised:
        allocate_past_device_memory(torch.device("cpu"))
    trace = f"Traceback (most recent call last):\n  ...\nRuntimeError: {raised.value}"
    record = {"level": "ERROR", "msg": "learner worker stopped with an error; exiting"}
    log = tmp_path / "learner.log"
    log.write_text(json.dumps(record | {"exc": trace}) + "\n")
    cause = last_error_line(log)
    assert "can't allocate memory" in cause
    assert failure_class(-15, cause) == "oom"  # the SIGTERM the learner sends itself


def test_a_learner_killed_by_sigkill_is_named_with_its_class_phase_and_resume_step(tmp_path):
    proc = popen_owned([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGKILL)
    failure = ServiceExited("learner", proc.wait(), tmp_path / "learner.log", None)
    assert failure.failure_class == "killed (SIGKILL)" and failure.status == -9
    assert "learner exited with status -9 while the job ran: killed (SIGKILL)" in str(failure)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-000010").mkdir(parents=True)
    (checkpoints / "step-000020").mkdir()
    (checkpoints / ".tmp-step-000030-123").mkdir()  # a save cut short does not count
    assert resume_step(checkpoints) == 20 and resume_step(tmp_path / "none") is None
    assert current_phase({"stack_start_s": 1.0, "eval_before_s": 2.0}) == "train"
    line = failure_message(failure, "train", tmp_path / "report", resume_hint(20))
    assert line == (
        f"learner exited with status -9 during train: killed (SIGKILL); see {tmp_path}/learner.log; "
        f"incomplete report in {tmp_path}/report; rerun without --fresh to resume from step 20"
    )
    assert "trains from step 0 again" in resume_hint(None)
    log = tmp_path / "learner.log"  # killed while it logged INFO records: no error to name
    log.write_text(
        '{"level": "INFO", "msg": "Uvicorn running"}\n'
        "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 61.51it/s]\n"
        '{"level": "INFO", "msg": "x"}\n'
    )
    assert last_error_line(log) is None
    log.write_text('{"level": "INFO", "msg": "step"}\nSegmentation fault (core dumped)\n')
    assert last_error_line(log) == "Segmentation fault (core dumped)"


def _incomplete_job(before: dict, phase: str, tasks_by_id: dict | None = None) -> JobOutcome:
    """A job the learner's SIGKILL cut short in `phase`: no after-evaluation, no checkpoint."""
    steps = [{"step": 1, "trajectories": ["t"], "reward_mean": 0.5, "seconds": 2.0}]
    return JobOutcome(
        before=before,
        after={},
        tasks_by_id=tasks_by_id or {},
        steps=steps if phase != "eval_before" else [],
        snapshots=[],
        metrics={},
        phases={"stack_start_s": 30.0, "eval_before_s": 20.0} if before else {},
        incomplete={
            "service": "learner",
            "status": -9,
            "class": "killed (SIGKILL)",
            "cause": None,
            "log": "/x/learner.log",
            "phase": phase,
            "resume_from_step": None,
            "rerun": resume_hint(None),
        },
    )


def test_the_report_of_a_job_cut_short_in_training_says_not_evaluated_without_numbers(tmp_path):
    tasks = generate("eval_id", count=4, seed=0)  # count_lines first
    before = {
        "eval_id": view({t.task_id: "s" if i < 1 else "w" for i, t in enumerate(tasks)}),
        "eval_ood": view({"gen-last_line-00000000000f": "w"}),
    }
    job = _incomplete_job(before, "train", {t.task_id: t for t in tasks})
    report = write_job_report(JobConfig(state_dir=tmp_path), job, t_start=0.0, t_train=None)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["incomplete"]["class"] == "killed (SIGKILL)"
    assert summary["sets"]["eval_id"]["before"]["rate"] == 0.25
    assert summary["sets"]["eval_id"]["after"] is None
    assert summary["templates"]["eval_id"]["count_lines"] == {
        "instances": 1,
        "before": 1.0,
        "after": None,
        "trajectory": [{"step": 0, "solved": 1.0}],  # the after-evaluation never ran
        "lost_at_step": None,
    }
    assert summary["target"] == {"met": False, "evaluated": False} and summary["regressions"] == []
    assert summary["line"] == (
        "incomplete: learner killed (SIGKILL) during train, no checkpoint | "
        "eval_id 25.0% -> not evaluated | eval_ood 0.0% -> not evaluated | target not evaluated"
    )
    assert summary["steps"] == 1
    text = (report / "report.md").read_text()
    assert text.splitlines()[2] == (
        "**Incomplete run**: learner exited with status -9 during train: killed (SIGKILL); log "
        "/x/learner.log. What follows is what ran until then; no checkpoint was written yet: a "
        "rerun without --fresh trains from step 0 again."
    )
    assert "| eval_id | 4 | 25.0% [" in text and "| not evaluated |" in text
    assert "| eval_id: count_lines | 1/1 | not evaluated |" in text
    assert not (report / "eval_before_after.png").exists()  # no bar for what did not run


def test_a_job_cut_short_before_any_evaluation_still_writes_its_report(tmp_path):
    cfg = JobConfig(state_dir=tmp_path)
    report = write_job_report(cfg, _incomplete_job({}, "eval_before"), t_start=0.0, t_train=None)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["sets"] == {} and summary["target"]["evaluated"] is False
    assert summary_line(summary) == (
        "incomplete: learner killed (SIGKILL) during eval_before, no checkpoint | "
        "eval_id not evaluated | eval_ood not evaluated | target not evaluated"
    )
    assert "Versions evaluated: before not evaluated" in (report / "report.md").read_text()


def test_status_names_a_process_that_exited_with_its_class_and_last_error(tmp_path):
    log = tmp_path / "learner.log"
    log.write_text('{"level": "INFO", "msg": "step"}\n' + OOM + "\n")
    dead = popen_owned([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: the pid no longer runs
    info = {
        "processes": {"learner": dead.pid, "rollout": os.getpid()},
        "logs": {"learner": str(log)},
    }
    exited = exited_processes(info)
    assert exited == {"learner": {"class": "oom", "cause": OOM}}
    snap = {"ready": {"learner": False, "rollout": True}, "streams": {}, "exited": exited}
    assert down_causes(snap) == [f"learner (exited: oom: {OOM})"]
    # the command itself, on a stack whose Redis is gone too
    nothing = f"127.0.0.1:{free_port()}"
    info |= {"urls": {"learner": f"http://{nothing}"}, "redis_url": f"redis://{nothing}/0"}
    (tmp_path / "stack.json").write_text(json.dumps(info))
    done = run_owned(
        [sys.executable, "-m", "cli.main", "status", "--state-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout_s=60,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"down: learner (exited: oom: {OOM}), redis"
    assert "learner exited" in done.stdout and "CUDA out of memory" in done.stdout
    # once the job stopped its stack: no stack.json, the incomplete report's line
    (tmp_path / "stack.json").unlink()
    (tmp_path / "report").mkdir()
    line = "incomplete: learner oom during train, resume from step 10 | target not evaluated"
    (tmp_path / "report" / "summary.json").write_text(
        json.dumps({"incomplete": {"service": "learner"}, "line": line})
    )
    done = run_owned(
        [sys.executable, "-m", "cli.main", "status", "--state-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout_s=60,
    )
    assert done.returncode == 1 and "no stack running" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"the last job stopped early: {line}"
