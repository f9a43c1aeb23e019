"""A service that dies while the main job runs (cli/main_job.py): which service (`service_exited`),
which phase it cut, the checkpoint a rerun resumes from, the incomplete report of what ran and
the job's one-line error (`report_failure`).

    learner exited with status -9 during train: killed (SIGKILL); see .shellrl/logs/learner.log
    (last error: ...); incomplete report in .shellrl/report; rerun without --fresh to resume
    from step 10

The learner restores its newest complete checkpoint (`<state>/checkpoints/step-NNNNNN`,
services/learner/checkpoint.py) when it starts, so `shellrl run` without `--fresh` on the same
state directory continues from that step up to `--steps` in all (checked by hand: a learner
SIGKILLed after checkpoint step-000001, the rerun logged `{"event": "resume", "step": 1}` and
trained steps 2-6). The rerun's before-evaluation measures the resumed policy: the learner reports
ready only after it pushed the checkpoint's weights to the engines (services/learner/app.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import httpx

from cli.console import cli_console
from cli.job_report import JobOutcome, read_steps, write_job_report
from cli.polling import poll_until
from cli.stack_failure import ServiceExited, StackError

console = cli_console()

# the job's phases on a started stack, in order; each records `<phase>_s` in phases.json when it
# ends, so the first without one is the phase a failure cut ("report": the last /metrics)
JOB_PHASES = ("eval_before", "train", "eval_after")
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def current_phase(phases: dict[str, float]) -> str:
    """The phase running when the job stopped: the first of JOB_PHASES without its wall time in
    `phases`, else "report"."""
    return next((p for p in JOB_PHASES if f"{p}_s" not in phases), "report")


def resume_step(checkpoint_dir: Path) -> int | None:
    """The step of the newest complete checkpoint under `checkpoint_dir` (the one the learner
    restores at start), None when there is none. Temporary `.tmp-step-*` directories of a save
    cut short do not count."""
    try:
        steps = [
            int(m.group(1)) for p in checkpoint_dir.iterdir() if (m := _STEP_DIR.match(p.name))
        ]
    except OSError:
        return None
    return max(steps) if steps else None


def resume_hint(step: int | None) -> str:
    """What a rerun without --fresh does, given `resume_step`."""
    if step is None:
        return "no checkpoint was written yet: a rerun without --fresh trains from step 0 again"
    return f"rerun without --fresh to resume from step {step}"


def failure_message(failure: ServiceExited, phase: str, report_dir: Path | None, hint: str) -> str:
    """The job's one-line error: the service, its exit status, the phase, the failure class, its
    log and last error line, where the incomplete report is (None: it could not be written) and
    `hint` (`resume_hint`)."""
    last = f" (last error: {failure.cause})" if failure.cause else ""
    report = f"incomplete report in {report_dir}" if report_dir else "no report (see above)"
    return (
        f"{failure.service} exited with status {failure.status} during {phase}: "
        f"{failure.failure_class}; see {failure.log_path}{last}; {report}; {hint}"
    )


def service_exited(stack, wait_s: float = 5.0) -> ServiceExited | None:
    """The service of `stack` (cli.launcher.Stack) that exited, waiting up to wait_s for one that
    refuses connections while it dies; None when every process still runs."""

    def exited() -> ServiceExited | None:
        try:
            stack.raise_if_exited()
        except ServiceExited as exc:
            return exc
        return None

    return poll_until(exited, timeout_s=wait_s, interval_s=0.5)


def last_metrics(url: Callable[[str], str]) -> dict[str, str]:
    """{service: /metrics text} of learner, rollout and engine, of those that answer. url: the
    stack's `StackConfig.url`."""
    out = {}
    for name in ("learner", "rollout", "engine"):
        try:
            out[name] = httpx.get(f"{url(name)}/metrics", timeout=10).text
        except httpx.HTTPError:
            pass
    return out


def report_failure(cfg, job: JobOutcome, failure: ServiceExited, t_start: float) -> NoReturn:
    """Write the report of what ran (`job`, filled as far as the job got), marked incomplete,
    then raise StackError with the job's one-line error (`failure_message`). cfg: the job's
    cli.job_config.JobConfig; t_start: unix s the job started."""
    phase = current_phase(job.phases)
    if phase == "train" and job.train_started_at is not None:
        job.phases["train_s"] = time.time() - job.train_started_at  # cut short
    job.steps = read_steps(cfg.state_dir)
    step = resume_step(cfg.state_dir / "checkpoints")
    job.incomplete = failure.record() | {
        "phase": phase,
        "resume_from_step": step,
        "rerun": resume_hint(step),
    }
    try:
        report_dir = write_job_report(cfg, job, t_start=t_start, t_train=job.train_started_at)
    except Exception as exc:  # the failure is the news; a report that cannot be written is noted
        console.print(f"[red]the incomplete report could not be written:[/] {exc!r}")
        report_dir = None
    raise StackError(failure_message(failure, phase, report_dir, job.incomplete["rerun"])) from None
