"""The engine's page faults and kernel time under a real rollout load, with allocator variants.

    python -m benchmarks.engine_faults 'base={}' 'jemalloc={"LD_PRELOAD": "'$JEMALLOC'", \
        "MALLOC_CONF": "retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1"}'

    (JEMALLOC=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2)

For each LABEL={extra engine env as JSON}: starts the stack without a learner (SmolLM2, engine on 2
threads, state in /tmp/shellrl-engine-faults), submits 60 generated train tasks as eval copies,
evaluates them at T = 1 with 4 episodes each (32 in flight), waits 45 s, then over 120 s prints
turns/s and the engine process's minor faults/s, user and system CPU seconds (from /proc/PID/stat).
Uses the default ports: no other stack may run. Diagnostic, not part of `make bench`.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import httpx


def _stat(pid: int) -> tuple[int, int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()
    return int(fields[7]), int(fields[11]), int(fields[12])  # minflt, utime, stime (clock ticks)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main(argv: list[str] | None = None) -> None:
    from cli.job_stack import submit
    from cli.launcher import Stack
    from cli.stack_config import SERVICE_ORDER, StackConfig
    from tasksets import load_taskset

    for spec in (sys.argv[1:] if argv is None else argv) or ["base={}"]:
        label, extra = spec.split("=", 1)
        state = Path("/tmp/shellrl-engine-faults")
        shutil.rmtree(state, ignore_errors=True)
        cfg = StackConfig(
            state_dir=state,
            model_path="smollm2",
            echo_logs=False,
            env={
                "SHELLRL_MAX_TURNS": "2",
                "SHELLRL_MAX_NEW_TOKENS": "40",
                "SHELLRL_EVAL_MAX_IN_FLIGHT": "32",
            },
            service_env={"engine": {"SHELLRL_NUM_THREADS": "2", **json.loads(extra)}},
            services=tuple(s for s in SERVICE_ORDER if s != "learner"),
        )
        with Stack(cfg) as stack:
            pid = json.loads(stack.pid_file.read_text())["processes"]["engine"]
            rollout = stack.config.url("rollout")
            client = httpx.Client(base_url=rollout, headers=stack.config.auth_headers())
            ids = submit(client, load_taskset("generated", "train", seed=0)[:60], eval_copy=True)
            client.post(
                "/v1/evaluations",
                json={
                    "task_ids": ids,
                    "greedy": False,
                    "episodes_per_task": 4,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 40},
                },
            ).raise_for_status()
            time.sleep(45)
            s0, t0, turns0 = (
                _stat(pid),
                time.time(),
                _metric(rollout, "shellrl_rollout_turns_total"),
            )
            time.sleep(120)
            s1, t1, turns1 = (
                _stat(pid),
                time.time(),
                _metric(rollout, "shellrl_rollout_turns_total"),
            )
        print(
            f"{label:>10}: turns/s {(turns1 - turns0) / (t1 - t0):.2f}  minflt/s {(s1[0] - s0[0]) / (t1 - t0):9.0f}  "
            f"utime {(s1[1] - s0[1]) / 100:.1f} s  stime {(s1[2] - s0[2]) / 100:.1f} s over {t1 - t0:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
