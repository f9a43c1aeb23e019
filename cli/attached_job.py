"""The main job against a stack that is already running (`shellrl run --attach URL`): docker
compose, Kubernetes or another `shellrl up`. Nothing is started or stopped; the job uses the
stack's URLs and its bearer token and runs the phases of cli/main_job.py:

    submit eval tasks ─▶ eval @ v ─▶ POST /v1/runs (train set, steps) ─▶ resume learner
                                        │ until the run's target version; GET /v1/runs/{id}
    report ◀─ eval @ v' ◀─ pause learner ◀─ run done / time up (or stop) ◀┘

The stack's own settings (group size, learning rate, staleness, temperature ...) apply; the job
chooses the train set, the steps, the time budget and the eval sets. The learner is resumed
once the run started (an earlier attached job leaves it paused) with the run's
`target_policy_version` as its step target, so `--steps N` ends at the start version + N: it
pauses itself there, never training the groups still in flight when the run is done; the job's
pause after the run then waits for that last step's push, so the "after" evaluation runs on one
policy version. The report has the learner's steps as the job saw them
in its status polls (every `POLL_S`; the learner's own ledger stays on its volume).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
from rich.table import Table

from cli.console import live_table
from cli.errors import CliError, http_errors
from cli.job_config import JobConfig
from cli.job_evaluations import evaluate
from cli.job_report import JobOutcome, write_job_report
from cli.job_stack import check_verifier_config, submit
from cli.job_tasks import eval_sets, train_tasks
from cli.job_tracking import log_evaluations, log_service_configs, open_tracker
from cli.main_job import console
from cli.polling import poll_until
from shellrl.contract import task_to_json

POLL_S = 3.0
# past the run's time budget: its last step and weight push, before the job stops waiting
RUN_END_GRACE_S = 15 * 60.0
LEARNER_PORT = 8103  # compose and the local stack publish the learner here


@dataclass(frozen=True)
class AttachTarget:
    """Where the running stack answers. headers: its bearer token header ({} without auth);
    verifier_url: None when not reachable from here (compose publishes no verifier port)."""

    rollout_url: str
    learner_url: str
    headers: dict
    verifier_url: str | None = None


def default_learner_url(rollout_url: str, port_offset: int = 0) -> str:
    """The learner beside a gateway: the gateway's host on LEARNER_PORT + `port_offset` (a local
    stack started with `--port-offset`)."""
    parts = urlsplit(rollout_url)
    port = LEARNER_PORT + port_offset
    return urlunsplit((parts.scheme, f"{parts.hostname}:{port}", "", "", ""))


def run_attached(cfg: JobConfig, target: AttachTarget) -> Path:
    """The whole job on a running stack; returns the report directory. Raises CliError when
    the stack cannot be reached, refuses the token, or another run is training on it."""
    t_start = time.time()
    sets, train_pool = eval_sets(cfg), train_tasks(cfg)
    client = httpx.Client(base_url=target.rollout_url.rstrip("/"), headers=target.headers)
    with client, http_errors("the stack stopped answering"):
        _check_reachable(client, target)
        if target.verifier_url:
            try:
                check_verifier_config(target.verifier_url, cfg.require_command, target.headers)
            except RuntimeError as exc:
                raise CliError(str(exc)) from None
        console.print(
            f"[bold]shellrl run --attach[/] {target.rollout_url}: {len(train_pool)} training "
            "tasks, eval sets " + ", ".join(f"{k} {len(v)}" for k, v in sets.items())
        )
        tracker = open_tracker(cfg)
        urls = {"rollout": target.rollout_url, "learner": target.learner_url}
        if target.verifier_url:
            urls["verifier"] = target.verifier_url
        log_service_configs(tracker, urls, target.headers)
        phases: dict[str, float] = {}
        eval_ids = {name: submit(client, tasks, eval_copy=True) for name, tasks in sets.items()}
        tasks_by_id = {i: t for name, ts in sets.items() for i, t in zip(eval_ids[name], ts)}
        t_eval = time.time()
        before = evaluate(client, eval_ids, "before", cfg.eval_samples, cfg.eval_temperature)
        phases["eval_before_s"] = time.time() - t_eval
        log_evaluations(tracker, before, tasks_by_id, client)
        t_train = time.time()
        run = start_run(client, train_pool, cfg)
        # no step past the run's target: groups still in flight when the run is done would
        # otherwise train one more step before the pause below lands
        _learner(target, "resume", until_version=run["target_policy_version"])
        console.print(f"run {run['run_id']} started ({run['submitted']})")
        snapshots = follow_run(client, target, run["run_id"], cfg)
        phases["train_s"] = time.time() - t_train
        _learner(target, "pause")  # the step in progress and its weight push finish first
        t_after = time.time()
        after = evaluate(client, eval_ids, "after", cfg.eval_samples, cfg.eval_temperature)
        phases["eval_after_s"] = time.time() - t_after
        log_evaluations(tracker, after, tasks_by_id, client)
        tracker.close()
        metrics = {
            name: httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text
            for name, url in (("learner", target.learner_url), ("rollout", target.rollout_url))
        }
    job = JobOutcome(before, after, tasks_by_id, steps_seen(snapshots), snapshots, metrics, phases)
    return write_job_report(cfg, job, t_start=t_start, t_train=t_train)


def start_run(client: httpx.Client, tasks: list, cfg: JobConfig) -> dict:
    """POST /v1/runs with the train set inline, `cfg.steps` and `cfg.time_budget_s`. Raises
    CliError when another run is training on the stack (409) or the gateway refuses the set."""
    body = {
        "tasks": [task_to_json(t) for t in tasks],
        "steps": cfg.steps,
        "time_budget_s": cfg.time_budget_s,
        "name": f"shellrl run --attach ({cfg.train_set})",
    }
    r = client.post("/v1/runs", json=body, timeout=300)
    if r.status_code in (409, 422):
        raise CliError(f"POST /v1/runs: {r.json().get('error', {}).get('message', r.text)}")
    r.raise_for_status()
    return r.json()


def follow_run(
    client: httpx.Client, target: AttachTarget, run_id: str, cfg: JobConfig
) -> list[dict]:
    """Poll the run and the learner every POLL_S with a live table until the run has ended;
    returns the snapshots ({time, elapsed_s, run, learner, rollout}). Ctrl-C stops the run."""
    snapshots: list[dict] = []
    t0 = time.monotonic()
    timeout_s = cfg.time_budget_s + RUN_END_GRACE_S  # the gateway ends the run at its budget
    try:
        with live_table(console) as live:

            def ended() -> bool:
                run = client.get(f"/v1/runs/{run_id}", timeout=30).json()
                snap = {
                    "time": time.time(),
                    "elapsed_s": time.monotonic() - t0,
                    "run": run,
                    "learner": _get(target.learner_url, "/v1/status", target.headers),
                    "rollout": _get(target.rollout_url, "/v1/status", target.headers),
                }
                snapshots.append(snap)
                live.update(progress_table(snap))
                return run["state"] != "training"

            if not poll_until(ended, timeout_s=timeout_s, interval_s=POLL_S):
                client.post(f"/v1/runs/{run_id}/stop", timeout=30)
                raise CliError(
                    f"run {run_id} still training {timeout_s:.0f} s after its start (time budget "
                    f"{cfg.time_budget_s:.0f} s); stopped it. See the gateway's and the "
                    "learner's logs",
                    exit_status=1,
                )
    except KeyboardInterrupt:
        client.post(f"/v1/runs/{run_id}/stop", timeout=30)
        raise
    run = snapshots[-1]["run"]
    console.print(f"run {run_id}: {run['state']} after {run['steps_done']}/{run['steps']} steps")
    return snapshots


def progress_table(snap: dict) -> Table:
    run, learner = snap["run"], snap.get("learner") or {}
    last, episodes = learner.get("last_step") or {}, run.get("episodes") or {}
    t = Table(title=f"shellrl run {run['run_id']}  ({snap['elapsed_s'] / 60:.1f} min)")
    row = {
        "state": run["state"],
        "step": f"{run['steps_done']}/{run['steps']}",
        "version": str(run["policy_version"]),
        "groups": str(run["groups_admitted"]),
        "episodes": f"{episodes.get('finished', 0)} ({episodes.get('failed', 0)} failed)",
        "success": _fmt(episodes.get("success_rate")),
        "last step reward": _fmt(last.get("reward_mean")),
        "step s": _fmt(last.get("seconds"), "{:.1f}"),
    }
    for column in row:
        t.add_column(column)
    t.add_row(*row.values())
    return t


def steps_seen(snapshots: list[dict]) -> list[dict]:
    """The learner's `last_step` records the snapshots saw, one per step, in step order."""
    steps: dict[int, dict] = {}
    for snap in snapshots:
        last = (snap.get("learner") or {}).get("last_step")
        if last and "step" in last:
            steps[last["step"]] = last
    return [steps[k] for k in sorted(steps)]


def _check_reachable(client: httpx.Client, target: AttachTarget) -> None:
    try:
        r = client.get("/v1/status", timeout=10)
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the rollout gateway at {target.rollout_url}: {exc}") from None
    if r.status_code == 401:
        raise CliError(
            f"{target.rollout_url} refused the token: pass --token or set SHELLRL_API_TOKEN"
        )
    r.raise_for_status()
    try:
        httpx.get(f"{target.learner_url.rstrip('/')}/readyz", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise CliError(
            f"the learner at {target.learner_url} is not ready ({exc}); pass --learner-url"
        ) from None


def _learner(target: AttachTarget, action: str, until_version: int | None = None) -> None:
    """POST /v1/resume (up to `until_version`) or /v1/pause (waiting for the step in progress)
    to the learner."""
    params = {"wait": "true"} if action == "pause" else {}
    if until_version is not None:
        params["until_version"] = until_version
    httpx.post(
        f"{target.learner_url.rstrip('/')}/v1/{action}",
        params=params,
        headers=target.headers,
        timeout=960,
    ).raise_for_status()


def _get(base: str, path: str, headers: dict) -> dict | None:
    try:
        r = httpx.get(f"{base.rstrip('/')}{path}", headers=headers, timeout=5)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _fmt(value, spec: str = "{:.3f}") -> str:
    return "-" if value is None else spec.format(value)
