"""The end of the main job (cli/main_job.py) and of the attached job (cli/attached_job.py): what
the phases measured (`JobOutcome`) becomes `<state>/report/`: the services' last /metrics,
phases.json, summary.json (cli/run_summary.py) and the report with its plots (cli/report.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cli.console import cli_console

console = cli_console()


@dataclass
class JobOutcome:
    """What the job's phases measured: evaluations before and after ({set: evaluation view}; {}
    when that evaluation did not run), the eval tasks by id, the learner's step records, the
    status snapshots taken while training, the services' last /metrics texts ({service: text})
    and the phases' wall seconds. incomplete: set when a service died and cut the job short
    (service, status, class, cause, log, phase, resume_from_step, rerun: cli/job_failure.py);
    train_started_at: unix s training started (None before it did); during: the evaluations
    during training in order ({set: view} each, eval_id and eval_ood: `eval_every_steps`)."""

    before: dict
    after: dict
    tasks_by_id: dict
    steps: list[dict]
    snapshots: list[dict]
    metrics: dict[str, str]
    phases: dict[str, float]
    incomplete: dict | None = None
    train_started_at: float | None = None
    during: list[dict] = field(default_factory=list)
    eval_kl: list[dict] = field(default_factory=list)  # cli/job_eval_kl.py, per evaluation


def write_job_report(cfg, job: JobOutcome, *, t_start: float, t_train: float | None) -> Path:
    """Write `<state>/report/`: metrics_<service>.prom, phases.json, summary.json and the report
    (cli/report.py); print the summary line. t_start, t_train: unix s of the job's and the
    training's start (None: training never started). cfg: the job's cli.job_config.JobConfig.
    A job cut short (`job.incomplete`) gets `incomplete` in summary.json, at the head of the
    summary line and of report.md, and "not evaluated" where an evaluation did not run. Returns
    the report directory."""
    from cli.report import write_report
    from cli.run_summary import summarize, summary_line

    report_dir = cfg.state_dir / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    before, after, tasks_by_id = job.before, job.after, job.tasks_by_id
    steps, phases = job.steps, job.phases
    for name, text in job.metrics.items():  # the services' last /metrics, Prometheus text
        (report_dir / f"metrics_{name}.prom").write_text(text)
    phases["total_s"] = time.time() - t_start
    (report_dir / "phases.json").write_text(
        json.dumps(phases | {"device": cfg.device, "gpu_layout": cfg.gpu_layout}, indent=2)
    )
    meta = job_meta(cfg, steps, phases)
    if job.incomplete is not None:
        meta["incomplete"] = job.incomplete
    summary = summarize(before, after, tasks_by_id, meta, job.during)
    summary["line"] = summary_line(summary)
    if job.eval_kl:
        summary["eval_kl"] = job.eval_kl
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    path = write_report(
        report_dir,
        summary=summary,
        config=asdict(cfg) | {"state_dir": str(cfg.state_dir)},
        before=before,
        after=after,
        during=job.during,
        steps=steps,
        snapshots=job.snapshots,
        learner_metrics=job.metrics.get("learner", ""),
        rollout_metrics=job.metrics.get("rollout", ""),
        engine_metrics=job.metrics.get("engine", ""),
        phases=phases,
        train_s=phases.get("train_s", 0.0),
        total_s=time.time() - t_start,
        tasks_by_id=tasks_by_id,
        train_started_at=t_train,
    )
    done = (
        "[bold yellow]incomplete report written:[/]"
        if job.incomplete
        else "[bold green]report written:[/]"
    )
    console.print(f"{done} {path}")
    console.print(f"[bold]summary:[/] {summary['line']}", soft_wrap=True)
    return report_dir


def job_meta(cfg, steps: list[dict], phases: dict) -> dict:
    """What summary.json says about the run besides its evaluations."""
    trained = [s for s in steps if "step" in s and "event" not in s]
    return {
        "seed": cfg.seed,
        "task_seed": cfg.task_seed,
        "eval_samples": cfg.eval_samples,
        "eval_temperature": cfg.eval_temperature,
        "dynamic_sampling": cfg.dynamic_sampling,
        "pass_rate_steering": cfg.pass_rate_steering,
        "kl_coef": cfg.kl_coef,
        "steps": len({s["step"] for s in trained}),
        "steps_with_training": len({s["step"] for s in trained if s.get("trajectories")}),
        "phases": phases,
    }


def read_steps(state_dir: Path) -> list[dict]:
    """The learner's step ledger, `<state>/checkpoints/steps.jsonl` ([] before its first step)."""
    ledger = state_dir / "checkpoints" / "steps.jsonl"
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
