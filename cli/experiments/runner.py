"""Run an experiment's points on one real stack (cli.launcher.Stack).

    start the stack with point 1's settings ─▶ wait for version 0 ─▶ submit tasks (t0)
        ─▶ wait window_s ─▶ read ledger, episodes, dropped ─▶ next point:
    kill rollout, learner, verifier (SIGKILL), sandbox (SIGTERM) ─▶ FLUSHALL ─▶ start them again
    with the next point's settings (fresh checkpoint directory) ─▶ ...

Redis and the engine run through all points: the engine keeps no state in Redis, and the new
learner pushes its initial weights as version 0 before any task is submitted (the engine then
serves version 0 again), so every point starts from the same weights and an empty Redis.
Ports are free ones (never a `shellrl up` stack's); the stack's state directory is emptied first
(a previous run's Redis AOF would replay its tasks); the sandbox's workspaces live in a fresh
temporary directory, removed at the end.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from cli.experiments.measure import (
    EpisodeRecord,
    PointResult,
    read_ledger,
    steps_from_ledger,
)
from cli.experiments.workload import Experiment, Point
from cli.launcher import Stack
from cli.stack_config import DEFAULT_PORTS, StackConfig
from cli.stack_failure import StackError
from shellrl import streams
from shellrl.contract import Failure, parse_trajectory
from shellrl.service.ports import free_port

RESTARTED = ("sandbox", "verifier", "rollout", "learner")  # in start order
VERSION_0_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class StackOptions:
    """model_path: tiny, smollm2 or a directory; device: cpu or cuda; state_dir: where the
    experiment's stack keeps Redis, logs and checkpoints."""

    state_dir: Path
    model_path: str = "tiny"
    device: str = "cpu"
    threads: int = 1


def stack_config(
    exp: Experiment, point: Point, opts: StackOptions, workspaces: Path
) -> StackConfig:
    return StackConfig(
        state_dir=opts.state_dir,
        model_path=opts.model_path,
        device=opts.device,
        ports={name: free_port() for name in DEFAULT_PORTS},
        env={
            **exp.env,
            "SHELLRL_NUM_THREADS": str(opts.threads),
            "SHELLRL_WORKSPACE_ROOT": str(workspaces),
            "SHELLRL_WEIGHT_SYNC_DIR": str((opts.state_dir / "weight_sync").resolve()),
        },
        service_env={k: dict(v) for k, v in point.service_env.items()},
        echo_logs=False,
        ready_timeout_s=600,
    )


def _use_point(config: StackConfig, point: Point, index: int) -> Path:
    """Point the config at `point`'s settings and a fresh checkpoint directory; returns it."""
    checkpoints = (config.state_dir / "points" / f"{index}" / "checkpoints").resolve()
    shutil.rmtree(checkpoints, ignore_errors=True)
    config.env["SHELLRL_CHECKPOINT_DIR"] = str(checkpoints)
    config.service_env = {k: dict(v) for k, v in point.service_env.items()}
    return checkpoints


def _switch(stack: Stack, point: Point, index: int) -> Path:
    """Stop every service but the engine, empty Redis, start them with `point`'s settings."""
    for name in reversed(RESTARTED):
        stack.kill(name, signal.SIGTERM if name == "sandbox" else signal.SIGKILL)
    redis.Redis.from_url(stack.config.redis_url).flushall()
    checkpoints = _use_point(stack.config, point, index)
    for name in RESTARTED:
        stack.restart(name)
    return checkpoints


def _wait_for_version_0(r: redis.Redis, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while r.get(streams.POLICY_VERSION_KEY) is None:
        if time.monotonic() > deadline:
            raise StackError(f"the learner published no policy version within {timeout_s:g} s")
        time.sleep(0.2)


def _episodes(r: redis.Redis, t0: float) -> list[EpisodeRecord]:
    out = []
    for _, fields in r.xrange(streams.STREAM_EPISODES):
        traj = parse_trajectory(fields[b"pb"])
        if traj.eval or not traj.finished_at:
            continue
        failure = Failure.Name(traj.failure) if traj.failure else ""
        out.append(EpisodeRecord(traj.created_at - t0, traj.finished_at - t0, failure))
    return out


def samples_by_label(metrics_text: str, sample_name: str, label: str) -> dict[str, float]:
    """{value of `label`: value} of the samples named `sample_name` in a /metrics text (e.g.
    shellrl_trajectories_dropped_total by reason)."""
    return {
        sample.labels.get(label, ""): sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == sample_name
    }


def measure(
    stack: Stack,
    exp: Experiment,
    point: Point,
    checkpoints: Path,
    start_s: float,
    tick: Callable[[float], None],
) -> PointResult:
    """Submit the tasks, wait the window, read what the point did. start_s: how long the
    point's services took to start (recorded with the result)."""
    r = redis.Redis.from_url(stack.config.redis_url)
    _wait_for_version_0(r, VERSION_0_TIMEOUT_S)
    headers = stack.config.auth_headers()
    resp = httpx.post(
        f"{stack.config.url('rollout')}/v1/tasks", json=list(exp.tasks), headers=headers, timeout=60
    )
    if resp.status_code != 201:
        raise StackError(f"POST /v1/tasks: {resp.status_code} {resp.text[:300]}")
    t0 = time.time()
    while (elapsed := time.time() - t0) < exp.window_s:
        dead = [p.name for p in stack.procs if p.popen.poll() is not None]
        if dead:
            raise StackError(f"{', '.join(dead)} exited during {point.name}; see {stack.log_dir}/")
        tick(elapsed)
        time.sleep(min(1.0, exp.window_s - elapsed))
    learner, rollout = (
        httpx.get(f"{stack.config.url(name)}/metrics", headers=headers, timeout=30).text
        for name in ("learner", "rollout")
    )
    waits = samples_by_label(rollout, "shellrl_rollout_admission_wait_seconds_sum", "reason")
    result = PointResult(
        name=point.name,
        settings=point.service_env,
        slots=point.slots,
        window_s=exp.window_s,
        steps=tuple(steps_from_ledger(read_ledger(checkpoints / "steps.jsonl"), t0)),
        episodes=tuple(_episodes(r, t0)),
        dropped=samples_by_label(learner, "shellrl_trajectories_dropped_total", "reason"),
        environment_wait_s=waits.get("sandbox_busy", 0.0),
        start_s=start_s,
    )
    r.close()
    return result


def run_experiment(
    exp: Experiment,
    opts: StackOptions,
    on_point: Callable[[PointResult], None] = lambda _: None,
    tick: Callable[[str, float], None] = lambda *_: None,
) -> list[PointResult]:
    """Every point of `exp` on one stack; `on_point` sees each result as it is measured and `tick`
    (point name, seconds into its window) about once a second. Raises StackError when the stack
    does not start or a service dies."""
    shutil.rmtree(opts.state_dir, ignore_errors=True)  # a previous run's Redis AOF and ledgers
    opts.state_dir.mkdir(parents=True)
    workspaces = Path(tempfile.mkdtemp(prefix="shellrl-experiment-"))
    workspaces.chmod(0o755)  # the sandbox's session uids traverse it
    config = stack_config(exp, exp.points[0], opts, workspaces)
    checkpoints = _use_point(config, exp.points[0], 0)
    results = []
    started = time.monotonic()
    try:
        with Stack(config) as stack:
            for index, point in enumerate(exp.points):
                if index:
                    started = time.monotonic()
                    checkpoints = _switch(stack, point, index)
                start_s = time.monotonic() - started
                result = measure(
                    stack,
                    exp,
                    point,
                    checkpoints,
                    start_s,
                    lambda s, name=point.name: tick(name, s),
                )
                results.append(result)
                on_point(result)
    finally:
        shutil.rmtree(workspaces, ignore_errors=True)
    return results
