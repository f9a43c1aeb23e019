"""The learner intake's capacity, measured by draining a backlog (control-plane benchmark).

At low rates the intake reads a few entries per XREADGROUP and its cost per trajectory is mostly
the loop's own (a read, the delivery bookkeeping, group release checks); the slope over the
sweep's points overstates what it costs at scale. Here: a stack whose learner starts paused (the
real worker's pause), until the gateways are held by the admission bound, every admitted group
has finished and the verifier has scored them all: (max_staleness + 1) x groups_per_step complete
groups wait in shellrl:trajectories. The gateways and the verifier are stopped, the learner is
resumed (SIGUSR1, what POST /v1/resume does) with a FakeStepCompute step of 0 s, and its CPU
seconds and wall time until every waiting trajectory is resolved (trained or dropped) give its
capacity: trajectories per second, and per CPU-second, of one intake process.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import httpx

from benchmarks.control_plane_probe import cpu_s, stream_lag
from benchmarks.control_plane_stack import Stack, StackConfig, start_stack


def _until(condition, deadline_s: float, stack: Stack, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        stack.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"drain: {what} not within {deadline_s} s")
        time.sleep(0.2)  # poll period of the condition


def _held(stack: Stack) -> bool:
    """Every gateway held by the admission bound with nothing in flight, the verifier done."""
    for url in stack.gateway_urls:
        status = httpx.get(f"{url}/v1/status", timeout=10).json()
        if status["admission"]["can_admit"] or status["episodes_in_flight"]:
            return False
    lag = stream_lag(stack.redis.url).get("verifier", {"pending": 1, "lag": 1})
    return lag["pending"] == 0 and lag["lag"] == 0


def _resolved(stack: Stack) -> float:
    try:
        stats = json.loads(stack.learner_stats.read_text())
    except (OSError, ValueError):
        return 0.0
    return stats["trained"] + sum(stats["dropped"].values())


def measure_drain(config: StackConfig, profile: Path, deadline_s: float = 300) -> dict:
    stack = start_stack(replace(config, learner_paused=True, step_s=0.0), profile)
    try:
        _until(lambda: _held(stack), deadline_s, stack, "gateways held by the bound")
        stack.stop_only([n for n in stack.procs if n.startswith("gateway")] + ["verifier"])
        backlog = stream_lag(stack.redis.url)["learner"]["lag"]
        pid = stack.procs["learner"].pid
        cpu0, start = cpu_s(pid), time.monotonic()
        os.kill(pid, signal.SIGUSR1)
        _until(lambda: _resolved(stack) >= backlog, deadline_s, stack, "backlog drained")
        wall, cpu = time.monotonic() - start, cpu_s(pid) - cpu0
    finally:
        stack.stop()
    return {
        "engines": config.engines,
        "trajectories": backlog,
        "seconds": wall,
        "cpu_s": cpu,
        "trajectories_per_s": backlog / wall,
        "ms_per_trajectory": 1000 * cpu / max(backlog, 1),
    }
