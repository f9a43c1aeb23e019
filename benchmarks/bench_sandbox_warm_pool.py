"""Episode start latency (session create + setup ready) with and without the sandbox warm pool
(issue 18 item 3: services/sandbox/sessions/warm_pool.py, shellrl/clients/sandbox_fleet.py).

For each setup script, arrival pattern and pool setting, `--services` real `python -m
services.sandbox` processes are started (bubblewrap, session exec mode) and driven through one
SandboxFleet the way the rollout gateway drives them. An episode creates its session (timed,
client side: the episode start), runs one command, holds the session `--hold-s` (its turns) and
deletes it. Tasks repeat (`--tasks` distinct setups, in turn), as groups and epochs repeat them.

* groups: GRPO-like bursts: a group of `--group-size` episodes of one task starts at once; the
  next group starts `--gap-s` after the previous one ended (the learner's step, the rest of
  the batch): the sandbox is idle between bursts;
* steady: `--concurrency` episodes always in flight, back to back: the sandbox is never idle.

Warm pool on: `--per-setup` ready sessions per setup, kept from the second request of a setup
on, at most per-setup x tasks per service. Printed: start latency p50 / p90 / p99 / mean, the
share of starts served warm, and episodes per second.

Run: `python -m benchmarks sandbox_warm_pool` or
`python -m benchmarks.bench_sandbox_warm_pool --groups 12 --episodes 48` (`--quick`: the groups
pattern with the first setup, pool off and on, one service).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETUPS = {
    "100 files": "for i in $(seq 100); do echo $i-{task} > f$i.txt; done",
    "100 files + 0.2 s": "for i in $(seq 100); do echo $i-{task} > f$i.txt; done; sleep 0.2",
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def start_services(n: int, root: Path, name: str, per_setup: int, tasks: int) -> list:
    from tests.helpers.processes import ServiceProcess
    from tests.helpers.redis_server import free_port

    services = []
    for i in range(n):
        env = {
            "SHELLRL_SANDBOX_ISOLATION": "bubblewrap",
            "SHELLRL_LOG_LEVEL": "WARNING",
            "SHELLRL_WORKSPACE_ROOT": str(root / f"{name}-{i}"),
            "SHELLRL_MAX_SESSIONS": "64",
            "SHELLRL_WARM_POOL_PER_SETUP": str(per_setup),
            "SHELLRL_WARM_POOL_MAX_SESSIONS": str(max(1, per_setup) * tasks),
            "SHELLRL_WARM_POOL_MIN_REPEATS": "2",
        }
        services.append(ServiceProcess("sandbox", free_port(), env, root / "logs").start())
    return services


async def drive(urls: list[str], setup: str, pattern: str, args) -> dict:
    from shellrl.clients.sandbox_fleet import SandboxFleet

    start_ms: list[float] = []
    warm_ms: list[float] = []
    cold_ms: list[float] = []
    async with SandboxFleet(urls, timeout_s=60) as fleet:

        async def episode(task: int) -> None:
            begin = time.perf_counter()
            session, _ = await fleet.create_session_when_free(
                poll_s=0.05, setup=setup.format(task=task)
            )
            start_ms.append((time.perf_counter() - begin) * 1000)
            (warm_ms if session.get("warm") else cold_ms).append(start_ms[-1])
            result = await fleet.exec(session["session_id"], "ls | wc -l")
            assert result.stdout == "100\n", result
            await asyncio.sleep(args.hold_s)
            await fleet.delete(session["session_id"])

        begin = time.perf_counter()
        if pattern == "groups":
            for group in range(args.groups):
                await asyncio.gather(*(episode(group % args.tasks) for _ in range(args.group_size)))
                await asyncio.sleep(args.gap_s)
        else:
            tasks = itertools.cycle(range(args.tasks))
            left = itertools.count(args.episodes, -1)

            async def back_to_back() -> None:
                while next(left) > 0:
                    await episode(next(tasks))

            await asyncio.gather(*(back_to_back() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - begin
    rate = len(start_ms) / elapsed
    return {"start_ms": start_ms, "warm_ms": warm_ms, "cold_ms": cold_ms, "rate": rate}


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(
        prog="bench_sandbox_warm_pool", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--groups", type=int, default=12, help="groups (pattern groups)")
    parser.add_argument("--group-size", type=int, default=4, help="episodes per group")
    parser.add_argument("--gap-s", type=float, default=1.0, help="idle time between groups, s")
    parser.add_argument("--episodes", type=int, default=48, help="episodes (pattern steady)")
    parser.add_argument("--concurrency", type=int, default=4, help="in flight (pattern steady)")
    parser.add_argument("--tasks", type=int, default=4, help="distinct task setups (repeating)")
    parser.add_argument("--hold-s", type=float, default=0.3, help="an episode's session time, s")
    parser.add_argument("--services", type=int, default=2, help="sandbox services in the fleet")
    parser.add_argument("--per-setup", type=int, default=2, help="warm sessions per setup (on)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="groups pattern, first setup, pool off and on, 1 service, 3 groups of 2 (seconds)",
    )
    args = parser.parse_args(argv)
    patterns, setups = ("groups", "steady"), SETUPS
    if args.quick:
        args.services, args.groups, args.group_size, args.gap_s = 1, 3, 2, 0.2
        args.tasks, args.hold_s, args.per_setup = 1, 0.05, 1
        patterns, setups = ("groups",), dict(list(SETUPS.items())[:1])
    if os.geteuid() != 0:
        raise SystemExit("bench_sandbox_warm_pool needs root (the sandbox service does)")
    console = Console(width=200)
    root = Path(tempfile.mkdtemp(prefix="shellrl-bench-warm-pool-"))
    os.chmod(root, 0o711)
    results = {}
    try:
        for pattern, (setup_name, setup), per_setup in itertools.product(
            patterns, setups.items(), (0, args.per_setup)
        ):
            name = f"{pattern}, {setup_name}, pool {'on' if per_setup else 'off'}"
            tag = f"{len(results)}"
            services = start_services(args.services, root, tag, per_setup, args.tasks)
            try:
                urls = [s.url for s in services]
                results[name] = asyncio.run(drive(urls, setup, pattern, args))
            finally:
                for service in services:
                    service.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    shapes = {
        "groups": f"groups: {args.groups} x {args.group_size} with {args.gap_s} s gaps",
        "steady": f"steady: {args.episodes} episodes, {args.concurrency} in flight",
    }
    table = Table(
        title=f"episode start (create + setup) over {args.services} sandbox services, "
        f"{args.tasks} repeating setups, {args.hold_s} s per episode; "
        + "; ".join(shapes[p] for p in patterns)
    )
    for col in (
        "pattern, setup, pool",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "mean ms",
        "warm starts",
        "warm p50 ms",
        "cold p50 ms",
        "eps/s",
    ):
        table.add_column(col, justify="left" if col.startswith("pattern") else "right")
    for name, r in results.items():
        ms = r["start_ms"]
        table.add_row(
            name,
            f"{statistics.median(ms):.1f}",
            f"{pct(ms, 90):.1f}",
            f"{pct(ms, 99):.1f}",
            f"{statistics.fmean(ms):.1f}",
            f"{len(r['warm_ms'])}/{len(ms)}",
            f"{statistics.median(r['warm_ms']):.1f}" if r["warm_ms"] else "",
            f"{statistics.median(r['cold_ms']):.1f}" if r["cold_ms"] else "",
            f"{r['rate']:.2f}",
        )
    console.print(table)
    load = os.getloadavg()
    console.print(
        f"load average after the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"cpus: {os.cpu_count()}"
    )


if __name__ == "__main__":
    main()
