"""Sandbox executor latency and throughput per isolation layer and exec mode (issue 3).

For each configuration (isolation layer x exec mode) a real `python -m services.sandbox` is
started; through its HTTP API (shellrl.clients.sandbox) we measure:

* exec latency of `true` in an existing session, sequentially (`--n` calls): p50 / p99 of the
  client-side wall time, and the ratio to the baseline;
* session create (setup writes 100 small files) and reset (back to those 100 files) latency;
* throughput: `--sessions` concurrent sessions each running `echo hi; ls` back to back for
  `--seconds`, commands/s.

Baseline in the same run: plain `subprocess.run(["bash", "-c", "true"])` from this process.
Run: `python -m benchmarks sandbox` or `python -m benchmarks.bench_sandbox --n 300` (`--quick`: the
default configuration, a few calls of each kind).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETUP_100_FILES = "for i in $(seq 100); do echo $i > f$i.txt; done"
CONFIGS = {
    "bubblewrap/session": ("bubblewrap", "session"),
    "bubblewrap/per_command": ("bubblewrap", "per_command"),
    "unshare/session": ("unshare", "session"),
    "fallback/session": ("fallback", "session"),
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def baseline_ms(n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(["bash", "-c", "true"], capture_output=True, check=False)
        out.append((time.perf_counter() - start) * 1000)
    return out


async def measure(url: str, n: int, reps: int, sessions: int, seconds: float) -> dict:
    from shellrl.clients.sandbox import SandboxClient

    async with SandboxClient(url, timeout_s=60) as client:
        session = await client.create_session(setup=SETUP_100_FILES)
        sid = session["session_id"]
        for _ in range(10):
            await client.exec(sid, "true")
        exec_ms, server_ms = [], []
        for _ in range(n):
            start = time.perf_counter()
            result = await client.exec(sid, "true")
            exec_ms.append((time.perf_counter() - start) * 1000)
            server_ms.append(result.duration_ms)
            assert result.exit_code == 0, result
        reset_ms = []
        for _ in range(reps):
            await client.exec(sid, "rm -f f1.txt; echo x > new.txt")
            start = time.perf_counter()
            await client.reset(sid)
            reset_ms.append((time.perf_counter() - start) * 1000)
        check = await client.exec(sid, "ls | wc -l; ls new.txt 2>/dev/null | wc -l")
        assert check.stdout == "100\n0\n", check
        await client.delete(sid)
        create_ms = []
        for _ in range(reps):
            start = time.perf_counter()
            created = await client.create_session(setup=SETUP_100_FILES)
            create_ms.append((time.perf_counter() - start) * 1000)
            await client.delete(created["session_id"])

        ids = [(await client.create_session())["session_id"] for _ in range(sessions)]
        done = 0
        stop_at = time.perf_counter() + seconds

        async def loop(session_id: str) -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                result = await client.exec(session_id, "echo hi; ls")
                assert result.exit_code == 0, result
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in ids))
        throughput = done / (time.perf_counter() - start)
        for i in ids:
            await client.delete(i)
    return {
        "exec_ms": exec_ms,
        "server_ms": server_ms,
        "reset_ms": reset_ms,
        "create_ms": create_ms,
        "throughput": throughput,
    }


def start_service(layer: str, mode: str, root: Path):
    from tests.helpers.processes import ServiceProcess
    from tests.helpers.redis_server import free_port

    env = {
        "SHELLRL_SANDBOX_ISOLATION": layer,
        "SHELLRL_SANDBOX_EXEC_MODE": mode,
        "SHELLRL_LOG_LEVEL": "WARNING",
        "SHELLRL_WORKSPACE_ROOT": str(root / f"{layer}-{mode}"),
        "SHELLRL_MAX_SESSIONS": "64",
    }
    return ServiceProcess("sandbox", free_port(), env, root / "logs").start()


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="bench_sandbox", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=int, default=300, help="sequential `true` execs per configuration"
    )
    parser.add_argument("--reps", type=int, default=30, help="creates and resets per configuration")
    parser.add_argument(
        "--sessions", type=int, default=16, help="concurrent sessions for throughput"
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="throughput window per configuration"
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the default configuration only, 20 execs, 3 creates, 2 sessions for 1 s (seconds)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.reps, args.sessions, args.seconds = 20, 3, 2, 1.0
        args.configs = next(iter(CONFIGS))
    if os.geteuid() != 0:
        raise SystemExit("bench_sandbox needs root (the sandbox service does)")
    console = Console(width=200)
    root = Path(tempfile.mkdtemp(prefix="shellrl-bench-sandbox-"))
    os.chmod(root, 0o711)
    results = {}
    try:
        base = baseline_ms(args.n)
        for name in args.configs.split(","):
            layer, mode = CONFIGS[name]
            service = start_service(layer, mode, root)
            try:
                results[name] = asyncio.run(
                    measure(service.url, args.n, args.reps, args.sessions, args.seconds)
                )
            finally:
                service.stop()
            base += baseline_ms(args.n // 3)  # interleave the baseline with the configurations
    finally:
        shutil.rmtree(root, ignore_errors=True)

    p50_base = statistics.median(base)
    table = Table(
        title=f"sandbox exec of `true` over HTTP (n={args.n}) vs subprocess.run(['bash','-c','true'])"
    )
    for col in (
        "configuration",
        "exec p50 ms",
        "exec p99 ms",
        "server p50 ms",
        "x baseline p50",
        "create p50 ms",
        "reset p50 ms",
        f"cmds/s ({args.sessions} sessions)",
    ):
        table.add_column(col, justify="right" if col != "configuration" else "left")
    table.add_row(
        "baseline: bash -c true", f"{p50_base:.2f}", f"{pct(base, 99):.2f}", "", "1.00", "", "", ""
    )
    for name, r in results.items():
        table.add_row(
            name,
            f"{statistics.median(r['exec_ms']):.2f}",
            f"{pct(r['exec_ms'], 99):.2f}",
            f"{statistics.median(r['server_ms']):.2f}",
            f"{statistics.median(r['exec_ms']) / p50_base:.2f}",
            f"{statistics.median(r['create_ms']):.1f}",
            f"{statistics.median(r['reset_ms']):.2f}",
            f"{r['throughput']:.0f}",
        )
    console.print(table)
    load = os.getloadavg()
    console.print(
        f"load average during the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cpus: {os.cpu_count()}"
    )


if __name__ == "__main__":
    main()
