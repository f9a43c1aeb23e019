"""The main job's evaluations (cli/main_job.py): start one evaluation per eval set on the
rollout gateway (POST /v1/evaluations), wait for all of them with a live status line, and log
their success (with its 95% interval, cli/eval_stats.py) and per-template table to the tracker
(`open_tracker`: the job's run, its options logged first).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from rich.console import Console

console = Console()


def evaluation_body(task_ids: list[str], samples: int, temperature: float) -> dict:
    """POST /v1/evaluations body: greedy with one episode per task when `temperature` is 0, else
    `samples` episodes per task sampled at `temperature` (seeded by the gateway's sampling_seed,
    the same seeds before and after training: services/rollout/seeding.py)."""
    if temperature <= 0:
        return {"task_ids": task_ids, "greedy": True, "episodes_per_task": 1}
    return {
        "task_ids": task_ids,
        "greedy": False,
        "sampling": {"temperature": temperature},
        "episodes_per_task": samples,
    }


def evaluate(
    client: httpx.Client,
    sets: dict[str, list[str]],
    label: str,
    samples: int = 1,
    temperature: float = 0.0,
    check_alive: Callable[[], None] = lambda: None,
) -> dict[str, dict]:
    """Start one evaluation per set (`evaluation_body`) and wait for all of them. check_alive:
    called every poll, raises when a service of the stack has exited (the launcher's
    `Stack.raise_if_exited`), so an engine that dies mid-evaluation ends the wait at once."""
    started = {}
    for name, ids in sets.items():
        r = client.post(
            "/v1/evaluations", json=evaluation_body(ids, samples, temperature), timeout=60
        )
        r.raise_for_status()
        started[name] = r.json()["evaluation_id"]
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    with console.status(f"[bold]evaluation {label}") as status:
        while len(results) < len(started):
            check_alive()
            for name, eid in started.items():
                if name in results:
                    continue
                view = client.get(f"/v1/evaluations/{eid}", timeout=30).json()
                if view.get("state") in ("done", "failed", "cancelled"):
                    results[name] = view
            done = sum(
                client.get(f"/v1/evaluations/{e}", timeout=30).json().get("episodes_done", 0)
                for e in started.values()
            )
            total = sum(len(v) for v in sets.values()) * (samples if temperature > 0 else 1)
            status.update(
                f"[bold]evaluation {label}: {done}/{total} episodes, {time.monotonic() - t0:.0f} s"
            )
            time.sleep(2)
    for name, view in results.items():
        console.print(
            f"  {label} {name:>10}: success {view.get('success_rate')}  ({view.get('episodes_scored')} "
            f"scored, versions {view.get('policy_versions_seen')}, outcomes {view.get('outcomes')})"
        )
    return results


SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def open_tracker(cfg):
    """The job's tracker (shellrl/tracking.py; run `job` under <state>/tracking, beside the
    learner's, one run name for both) with the job's options logged as its config: the tracker
    and <state>/tracking/job/config.json. [env] values whose names hold a secret word are
    logged as '***'."""
    from dataclasses import asdict

    from shellrl.tracking import TrackingConfig, create_tracker

    tracker = create_tracker(TrackingConfig(backend=cfg.tracker), "job", cfg.state_dir / "tracking")
    config = asdict(cfg)
    config["extra_env"] = {
        name: "***" if any(w in name.upper() for w in SECRET_WORDS) else value
        for name, value in cfg.extra_env.items()
    }
    tracker.log_config(config)
    return tracker


def log_evaluations(tracker, results: dict[str, dict], tasks_by_id: dict) -> None:
    """Success with n and its 95% interval per eval set, and a per-template table, at the policy
    version the evaluation ran on."""
    from cli.report import per_template
    from cli.report_plots import eval_bar

    for name, view in results.items():
        rate, n, lo, hi = eval_bar(view)
        step = max(view.get("policy_versions_seen") or [0])
        tracker.log_metrics(
            {
                f"eval/{name}/success_rate": rate,
                f"eval/{name}/success_low": lo,
                f"eval/{name}/success_high": hi,
                f"eval/{name}/episodes": n,
            },
            step,
        )
        rows = [
            [t, s, e, round(s / e, 4) if e else None]
            for t, (s, e) in sorted(per_template(view, tasks_by_id).items())
        ]
        columns = ["template", "successes", "episodes", "success_rate"]
        tracker.log_table(f"eval/{name}/per_template", columns, rows, step)
