"""The main job (`shellrl run`, what `make run` calls): start the stack, evaluate, train, evaluate
again, write a report.

    start stack ─▶ submit eval tasks ─▶ eval @ v0 ─▶ submit train tasks ─▶ train N steps
                                                                            (live progress)
    report ◀─ eval @ v_final ◀─ pause learner ◀────────────────────────────────┘

With `eval_every_steps` = k > 0, training pauses at every k-th step for an evaluation of eval_id
and eval_ood on that step's weights (outside the time budget), so a template's loss is dated to
the evaluation that first shows it (cli/template_trajectories.py).

Eval sets (fixed, greedy, identical before and after): `eval_id` (held-out instances of the
training templates), `eval_ood` (templates never trained on), the seed tasks and a fixed sample
of the AgentBench training tasks. Training pool: the tasks of `--train-set`. With `eval_samples`
> 1, each task is evaluated by that many episodes sampled at `eval_temperature` (estimator:
cli/eval_stats.py). The task sets come from `task_seed` (fixed across runs, so runs compare on
one eval set); `seed` drives everything random in a run: the engine's sampling (a seed per
request, services/rollout/seeding.py), the epoch order of the pool and the learner's RNGs.

The job ends with `summary.json` and one summary line (cli/run_summary.py): eval_id and eval_ood
before -> after, whether the target is met, and every template that lost solved instances.

A service that dies on the way (the learner's CUDA OOM, an engine crash, a SIGKILL) stops the job
at the next poll: the stack stops, the report is written from what exists (the evaluations done,
the learner's step ledger, the status snapshots, the phases), marked `incomplete` with the
service, its failure class and the phase, and the job exits 1 with one line naming all of it and
the checkpoint a rerun resumes from (cli/job_failure.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rich.table import Table

from cli.console import cli_console, live_table
from cli.job_config import JobConfig
from cli.job_eval_kl import eval_kl
from cli.job_evaluations import evaluate
from cli.job_failure import last_metrics, report_failure, service_exited
from cli.job_report import JobOutcome, read_steps, write_job_report
from cli.job_stack import check_verifier_config, submit, wait_for_served_policy
from cli.job_tasks import eval_sets, train_tasks
from cli.job_tracking import log_evaluations, log_service_configs, open_tracker
from cli.launcher import Stack
from cli.polling import poll_until
from cli.stack_config import (
    api_headers,
)
from cli.stack_failure import ServiceExited
from cli.stack_status import collect, shown

console = cli_console()


# --- training progress ---------------------------------------------------------------------------


def progress_table(snap: dict, cfg: JobConfig, elapsed_s: float) -> Table:
    learner = snap.get("learner") or {}
    last = learner.get("last_step") or {}
    rollout = snap.get("rollout") or {}
    t = Table(title=f"shellrl training  ({elapsed_s / 60:.1f} min)", show_header=True)
    for col in (
        "step",
        "version",
        "reward",
        "success",
        "staleness p50/p90",
        "tokens/s",
        "step s",
        "in flight",
    ):
        t.add_column(col)
    st = snap.get("staleness") or {}
    t.add_row(
        f"{shown(learner.get('step'))}/{cfg.steps}",
        shown(snap["streams"].get("_policy_version")),
        shown(last.get("reward_mean"), ".3f"),
        shown(last.get("success_rate"), ".3f"),
        f"{shown(st.get(0.5))}/{shown(st.get(0.9))}",
        shown(last.get("tokens_per_second"), ".0f"),
        shown(last.get("seconds"), ".1f"),
        shown(rollout.get("episodes_in_flight")),
    )
    return t


def eval_points(steps: int, every: int) -> list[int]:
    """The steps after which the job evaluates during training (`eval_every_steps`; 0: none):
    every multiple of `every` below `steps` (the after-evaluation covers `steps` itself)."""
    return list(range(every, steps, every)) if every > 0 else []


def train(
    cfg: JobConfig,
    info: dict,
    learner_url: str,
    check_alive: Callable[[], None] = lambda: None,
    snapshots: list[dict] | None = None,
    evaluate_at: Callable[[int], None] = lambda step: None,
) -> list[dict]:
    """Resume the learner and watch it until `cfg.steps` steps or the time budget; returns status
    snapshots. check_alive: called every poll, raises when a service of the stack has exited (the
    launcher's `Stack.raise_if_exited`), so a dead learner ends the job at once with its cause.
    snapshots: the list to append them to as they are taken (what it holds survives such a
    raise). evaluate_at(step): called at each of `eval_points`, with the learner paused at that
    step and its weights served (POST /v1/resume?until_version=step, then /v1/pause?wait); the
    time it takes is not part of the time budget."""
    snapshots = [] if snapshots is None else snapshots
    headers = api_headers(environ={"SHELLRL_API_TOKEN_FILE": info["api_token_file"]})
    t0, spent_s = time.monotonic(), 0.0  # spent_s: seconds of training so far
    for target in [*eval_points(cfg.steps, cfg.eval_every_steps), cfg.steps]:
        httpx.post(
            f"{learner_url}/v1/resume",
            params={"until_version": target},
            timeout=30,
            headers=headers,
        ).raise_for_status()
        t_part = time.monotonic()
        with live_table(console) as live:

            def trained() -> bool:  # a snapshot every 3 s until the target or the time budget
                check_alive()
                snap = collect(info)
                snap["elapsed_s"] = time.monotonic() - t0
                snapshots.append({k: v for k, v in snap.items() if k != "ready"})
                live.update(progress_table(snap, cfg, snap["elapsed_s"]))
                return ((snap.get("learner") or {}).get("step") or 0) >= target

            reached = poll_until(
                trained, timeout_s=max(cfg.time_budget_s - spent_s, 0.0), interval_s=3.0
            )
        spent_s += time.monotonic() - t_part
        # wait for the step in progress and its weight push: an evaluation runs on one version
        httpx.post(
            f"{learner_url}/v1/pause", params={"wait": "true"}, timeout=960, headers=headers
        ).raise_for_status()
        if not reached or target == cfg.steps:
            break
        evaluate_at(target)
    return snapshots


def run_job(cfg: JobConfig) -> Path:
    """The whole job; returns the report directory. Raises StackError (exit status 1) when a
    service dies on the way, after writing the incomplete report (module docstring)."""
    (cfg.state_dir / "report").mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    sets = eval_sets(cfg)
    train_pool = train_tasks(cfg)
    console.print(
        f"[bold]shellrl run[/]: model {cfg.model_path} on {cfg.device}"
        + (f" ({cfg.gpu_layout})" if cfg.device == "cuda" else "")
        + ", "
        f"{len(train_pool)} training tasks, eval sets "
        + ", ".join(f"{k} {len(v)}" for k, v in sets.items())
    )
    tracker = open_tracker(cfg)
    # filled phase by phase (wall seconds of each stage in `phases`), so a failure reports what ran
    job = JobOutcome(
        before={}, after={}, tasks_by_id={}, steps=[], snapshots=[], metrics={}, phases={}
    )
    failure = None
    try:
        with Stack(cfg.stack_config()) as stack:
            try:
                _job_on_stack(cfg, stack, sets, train_pool, tracker, job, t_start)
            except (ServiceExited, httpx.TransportError) as exc:
                # a refused connection is a service that died: name it, else it is the error
                failure = exc if isinstance(exc, ServiceExited) else service_exited(stack)
                if failure is None:
                    raise
                job.metrics = last_metrics(stack.config.url)
    finally:
        tracker.close()
    if failure is not None:
        report_failure(cfg, job, failure, t_start)
    return write_job_report(cfg, job, t_start=t_start, t_train=job.train_started_at)


def _job_on_stack(
    cfg: JobConfig,
    stack: Stack,
    sets: dict,
    train_pool: list,
    tracker,
    job: JobOutcome,
    t_start: float,
) -> None:
    """The job's stages on a started stack (run_job): evaluations, training, the services' last
    metrics, filled into `job` as they finish (`job.phases`: the wall seconds of each)."""
    info = json.loads(stack.pid_file.read_text())
    phases = job.phases
    phases["stack_start_s"] = time.time() - t_start
    console.print(f"stack up in {phases['stack_start_s']:.0f} s; logs in {stack.log_dir}/")
    headers = stack.config.auth_headers()
    urls = {name: stack.config.url(name) for name in stack.config.services}
    log_service_configs(tracker, urls, headers)
    check_verifier_config(stack.config.url("verifier"), cfg.require_command, headers)
    client = httpx.Client(base_url=stack.config.url("rollout"), headers=headers)
    eval_ids = {name: submit(client, tasks, eval_copy=True) for name, tasks in sets.items()}
    tasks_by_id = {i: t for name, ts in sets.items() for i, t in zip(eval_ids[name], ts)}
    job.tasks_by_id = tasks_by_id
    alive = stack.raise_if_exited
    served = wait_for_served_policy(stack.config.url("learner"), headers, alive)
    if served:
        console.print(f"the learner resumed at step {served}; evaluating that policy")
    t_eval = time.time()
    job.before = evaluate(client, eval_ids, "before", cfg.eval_samples, cfg.eval_temperature, alive)
    phases["eval_before_s"] = time.time() - t_eval
    log_evaluations(tracker, job.before, tasks_by_id, client)
    submit(client, train_pool)
    learner = httpx.Client(base_url=stack.config.url("learner"), headers=headers)

    def evaluate_at(step: int) -> None:  # eval_id and eval_ood at a step during training
        if step <= served:  # a resumed learner is past it already
            return
        t = time.time()
        ids = {k: v for k, v in eval_ids.items() if k in ("eval_id", "eval_ood")}
        label, k, temp = f"at step {step}", cfg.eval_samples, cfg.eval_temperature
        views = evaluate(client, ids, label, k, temp, alive)
        job.during.append(views)
        if cfg.eval_kl:
            job.eval_kl.append(eval_kl(client, learner, views, tasks_by_id))
        phases["eval_during_s"] = phases.get("eval_during_s", 0.0) + time.time() - t
        log_evaluations(tracker, views, tasks_by_id, client)

    t_train = job.train_started_at = time.time()
    train(cfg, info, stack.config.url("learner"), alive, job.snapshots, evaluate_at)
    during_s = phases.get("eval_during_s", 0.0)
    train_s = phases["train_s"] = time.time() - t_train - during_s
    job.after = evaluate(client, eval_ids, "after", cfg.eval_samples, cfg.eval_temperature, alive)
    phases["eval_after_s"] = time.time() - t_train - train_s - during_s
    if cfg.eval_kl and job.after:
        job.eval_kl.append(eval_kl(client, learner, job.after, tasks_by_id))
    log_evaluations(tracker, job.after, tasks_by_id, client)
    job.metrics = {
        name: httpx.get(f"{stack.config.url(name)}/metrics", timeout=10).text
        for name in ("learner", "rollout", "engine")
    }
    job.steps = read_steps(cfg.state_dir)
