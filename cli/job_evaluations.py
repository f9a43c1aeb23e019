"""The main job's evaluations (cli/main_job.py): start one evaluation per eval set on the
rollout gateway (POST /v1/evaluations), wait for all of them with a live status line, and log
their success (with its 95% interval, cli/eval_stats.py): what cli/job_tracking.py logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from cli.console import cli_console
from cli.errors import CliError
from cli.polling import poll_until

console = cli_console()
# the longest the job waits for its evaluations: the main job's take 3-10 min on 2 CPU cores
EVALUATION_TIMEOUT_S = 3 * 3600.0


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
    timeout_s: float = EVALUATION_TIMEOUT_S,
) -> dict[str, dict]:
    """Start one evaluation per set (`evaluation_body`) and wait for all of them, polling every
    2 s. check_alive: called every poll, raises when a service of the stack has exited (the
    launcher's `Stack.raise_if_exited`), so an engine that dies mid-evaluation ends the wait at
    once. Raises CliError (exit status 1) naming the evaluations not finished after
    `timeout_s`."""
    started = {}
    for name, ids in sets.items():
        r = client.post(
            "/v1/evaluations", json=evaluation_body(ids, samples, temperature), timeout=60
        )
        r.raise_for_status()
        started[name] = r.json()["evaluation_id"]
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    total = sum(len(v) for v in sets.values()) * (samples if temperature > 0 else 1)
    with console.status(f"[bold]evaluation {label}") as status:

        def finished() -> bool:  # every evaluation done, failed or cancelled
            check_alive()
            done = 0
            for name, eid in started.items():
                view = results.get(name) or client.get(f"/v1/evaluations/{eid}", timeout=30).json()
                if view.get("state") in ("done", "failed", "cancelled"):
                    results[name] = view
                done += view.get("episodes_done", 0)
            status.update(
                f"[bold]evaluation {label}: {done}/{total} episodes, {time.monotonic() - t0:.0f} s"
            )
            return len(results) == len(started)

        if not poll_until(finished, timeout_s=timeout_s, interval_s=2.0):
            waiting = ", ".join(f"{n} ({started[n]})" for n in started if n not in results)
            raise CliError(
                f"evaluation {label}: {waiting} not finished after {timeout_s:.0f} s; see the "
                "rollout gateway's log",
                exit_status=1,
            )
    for name, view in results.items():
        console.print(
            f"  {label} {name:>10}: success {view.get('success_rate')}  ({view.get('episodes_scored')} "
            f"scored, versions {view.get('policy_versions_seen')}, outcomes {view.get('outcomes')})"
        )
    return results
