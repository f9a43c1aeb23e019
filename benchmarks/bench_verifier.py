"""Verification latency per check type, and verifications per second through the stream (issue 6).

Part 1, latency: `Verifier.verify` (the code path of POST /v1/verify and of the stream worker)
with one check of each type, against a real sandbox service, `--reps` times each; answer checks
run without a session (pure), workspace checks in a session holding a small file. Baseline in the
same run: a bare sandbox exec of `true` in the same session (what any check command costs at
least). Every verification with a session also asks the sandbox for the session's safety
events (one GET) before its checks.

Part 2, stream: `--episodes` episodes of the seed task `seed-numbers` (answer + file_exists +
command_output_equals), each with its own solved sandbox session, are XADDed to
shellrl:episodes of a real redis-server; a verifier service subprocess (worker concurrency
`--concurrency`) scores them, releases their sessions and forwards them to shellrl:trajectories.
verifications/s = episodes / (last scored_at - first XADD); latency per episode = scored_at - its
XADD time (includes queueing). Baseline in the same run: `true` execs/s with the same number of
concurrent sandbox sessions.

Run: `python -m benchmarks verifier` (or `python -m benchmarks.bench_verifier --reps 50 --episodes 64`;
`--quick`: 3 verifications per check type, 4 episodes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHECKS = {
    "answer_equals": {"type": "answer_equals", "expected": "linux"},
    "answer_integer_equals": {"type": "answer_integer_equals", "expected": 5},
    "answer_matches": {"type": "answer_matches", "pattern": "[a-z]+"},
    "file_exists": {"type": "file_exists", "path": "data.txt"},
    "file_contains": {"type": "file_contains", "path": "data.txt", "substring": "40"},
    "file_sha256": {"type": "file_sha256", "path": "data.txt", "sha256": "0" * 64},
    "command_output_equals": {
        "type": "command_output_equals",
        "command": "wc -l < data.txt",
        "expected": "100",
    },
    "command_output_equals (reference, cached)": {
        "type": "command_output_equals",
        "command": "wc -l < data.txt",
        "reference_command": "wc -l < data.txt",
    },
    "command_exit_code": {"type": "command_exit_code", "command": "test -s data.txt"},
}
ANSWERS = {"answer_equals": "linux", "answer_integer_equals": "5", "answer_matches": "linux"}
SETUP = "seq 1 100 > data.txt"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def check_latency(sandbox_url: str, reps: int) -> tuple[dict[str, list[float]], list[float]]:
    from services.verifier.parts import build_verifier
    from services.verifier.settings import VerifierSettings
    from shellrl.clients.sandbox import SandboxClient
    from shellrl.contract import task_from_json

    async with SandboxClient(sandbox_url) as sandbox:
        verifier = build_verifier(
            VerifierSettings(sandbox_url=sandbox_url, worker_enabled=False), sandbox
        )
        sid = (await sandbox.create_session(setup=SETUP))["session_id"]
        baseline = []
        for _ in range(3):
            await sandbox.exec(sid, "true")
        latencies: dict[str, list[float]] = {name: [] for name in CHECKS}
        for i in range(reps):  # interleaved, so drift of the shared machine hits every type alike
            start = time.perf_counter()
            await sandbox.exec(sid, "true")
            baseline.append((time.perf_counter() - start) * 1000)
            for name, check in CHECKS.items():
                task = task_from_json(
                    {"task_id": "bench", "instruction": "x", "setup": SETUP, "check": check}
                )
                answer_only = name in ANSWERS
                start = time.perf_counter()
                result = await verifier.verify(
                    task, ANSWERS.get(name), None if answer_only else sid
                )
                latencies[name].append((time.perf_counter() - start) * 1000)
                if not result.scored:
                    raise RuntimeError(f"{name}: {result.failure_detail}")
        await sandbox.delete(sid)
    return latencies, baseline


async def stream_throughput(
    redis_url: str, sandbox_url: str, verifier, episodes: int, concurrency: int
) -> dict:
    from shellrl import streams
    from shellrl.clients.sandbox import SandboxClient
    from shellrl.contract import EpisodeEnd, Trajectory, parse_trajectory
    from tasksets.seeds import seed_tasks

    task = next(t for t in seed_tasks() if t.task_id == "seed-numbers")
    redis = streams.connect(redis_url)
    async with SandboxClient(sandbox_url) as sandbox:
        sids = []
        for _ in range(episodes):
            sid = (await sandbox.create_session())["session_id"]
            await sandbox.exec(sid, task.reference_solution)
            sids.append(sid)
        # baseline: bare `true` execs with `concurrency` sessions in parallel
        per_worker = max(1, episodes // concurrency) * 3

        async def loop(sid: str) -> None:
            for _ in range(per_worker):
                await sandbox.exec(sid, "true")

        start = time.perf_counter()
        await asyncio.gather(*(loop(s) for s in sids[:concurrency]))
        exec_per_s = per_worker * concurrency / (time.perf_counter() - start)

        producer = streams.StreamProducer(redis, streams.STREAM_EPISODES)
        added_at = {}
        verifier.start()
        t0 = time.time()
        for i, sid in enumerate(sids):
            traj = Trajectory(
                trajectory_id=f"b{i}",
                task_id=task.task_id,
                group_id=f"g{i // 8}",
                task=task,
                sandbox_session_id=sid,
                answer="5",
                end=EpisodeEnd.EPISODE_END_ANSWER,
            )
            added_at[traj.trajectory_id] = time.time()
            await producer.add(
                traj.SerializeToString(),
                idempotency_key=traj.trajectory_id,
                task_id=task.task_id,
                group_id=traj.group_id,
                version="0",
            )
        deadline = time.monotonic() + 300
        while await redis.xlen(streams.STREAM_TRAJECTORIES) < episodes:
            if time.monotonic() > deadline:
                raise RuntimeError("the verifier did not finish in 300 s")
            await asyncio.sleep(0.02)
        out = [
            parse_trajectory(f[b"pb"]) for _, f in await redis.xrange(streams.STREAM_TRAJECTORIES)
        ]
    await redis.aclose()
    if not all(t.scored and t.reward == 1.0 for t in out):
        raise RuntimeError("a benchmark episode was not scored 1")
    latencies = [(t.scored_at - added_at[t.trajectory_id]) * 1000 for t in out]
    return {
        "per_s": episodes / (max(t.scored_at for t in out) - t0),
        "latencies": latencies,
        "exec_per_s": exec_per_s,
    }


class _Deferred:
    """A verifier subprocess started only when the episodes are about to be added."""

    def __init__(self, make) -> None:
        self.make, self.proc = make, None

    def start(self) -> None:
        self.proc = self.make().start()

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_verifier", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=40, help="verifications per check type")
    p.add_argument("--episodes", type=int, default=64, help="episodes through the stream")
    p.add_argument("--concurrency", type=int, default=8, help="verifier worker concurrency")
    p.add_argument(
        "--quick", action="store_true", help="3 verifications per check, 4 episodes (seconds)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.episodes, args.concurrency = 3, 4, 2

    from rich.console import Console
    from rich.table import Table

    sys.path.insert(0, str(REPO))
    from tests.helpers.processes import ServiceProcess
    from tests.helpers.redis_server import RedisServer, free_port

    with tempfile.TemporaryDirectory(prefix="shellrl-bench-verifier-") as tmp:
        tmp = Path(tmp)
        sandbox = ServiceProcess(
            "sandbox",
            free_port(),
            {"SHELLRL_LOG_LEVEL": "WARNING", "SHELLRL_MAX_SESSIONS": str(args.episodes + 16)},
            tmp / "logs",
        ).start()
        server = RedisServer(tmp / "redis").start()
        verifier = _Deferred(
            lambda: ServiceProcess(
                "verifier",
                free_port(),
                {
                    "SHELLRL_REDIS_URL": server.url,
                    "SHELLRL_SANDBOX_URL": sandbox.url,
                    "SHELLRL_LOG_LEVEL": "WARNING",
                    "SHELLRL_CONCURRENCY": str(args.concurrency),
                    "SHELLRL_BLOCK_MS": "100",
                },
                tmp / "logs",
            )
        )
        try:
            latencies, baseline = asyncio.run(check_latency(sandbox.url, args.reps))
            stream = asyncio.run(
                stream_throughput(
                    server.url, sandbox.url, verifier, args.episodes, args.concurrency
                )
            )
        finally:
            verifier.stop()
            server.stop()
            sandbox.stop()

    console = Console(width=140)
    base_p50 = statistics.median(baseline)
    table = Table(
        title=f"Verifier: latency of one verification with one check, {args.reps} each "
        f"({os.cpu_count()} CPUs); baseline = bare sandbox exec of `true`"
    )
    for col in ("check type", "p50 ms", "p99 ms", "p50 vs exec"):
        table.add_column(col, justify="left" if col == "check type" else "right")
    table.add_row(
        "baseline: sandbox exec `true`", f"{base_p50:.2f}", f"{pct(baseline, 0.99):.2f}", "1.00x"
    )
    for name, values in latencies.items():
        table.add_row(
            name + (" (no session)" if name in ANSWERS else ""),
            f"{statistics.median(values):.2f}",
            f"{pct(values, 0.99):.2f}",
            f"{statistics.median(values) / base_p50:.2f}x",
        )
    console.print(table)
    lat = stream["latencies"]
    table = Table(
        title=f"Verifier stream: {args.episodes} episodes of seed-numbers (3 checks), worker concurrency "
        f"{args.concurrency}, sessions released"
    )
    for col in ("measure", "value"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    table.add_row(
        "verifications/s through shellrl:episodes -> shellrl:trajectories", f"{stream['per_s']:.1f}"
    )
    table.add_row(
        "baseline: sandbox `true` execs/s, same concurrency", f"{stream['exec_per_s']:.1f}"
    )
    table.add_row("ratio verifications / execs", f"{stream['per_s'] / stream['exec_per_s']:.2f}")
    table.add_row(
        "per-episode latency p50 ms (XADD -> scored, incl. queueing)",
        f"{statistics.median(lat):.1f}",
    )
    table.add_row("per-episode latency p99 ms", f"{pct(lat, 0.99):.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
