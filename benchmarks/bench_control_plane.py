"""The control plane at cluster scale, measured by simulation (issue 35):
`python -m benchmarks.bench_control_plane [--quick]`.

The shared parts run for real: redis-server, R rollout gateway processes (`python -m
services.rollout`: task pool, admission Lua scripts on one key, agent loop, XADD of every
trajectory), the verifier (`python -m services.verifier`: its stream worker and checks) and the
learner's intake (the real LearnerWorker loop: stream consumption, group assembly, staleness,
acknowledgement at checkpoints; benchmarks/control_plane_learner.py). N simulated engines and
one simulated sandbox fleet (FakeLatencyEngine, FakeLatencySandbox in tests/fakes/fake_latency.py)
answer the same HTTP APIs after latencies taken from recorded measurements
(benchmarks/control_plane_profile.py: the H200 GPU job's /generate histogram and episode shape,
the sandbox benchmark's exec and create times); the learner's step is a fake of 1.27 s (the GPU
job's median) with groups_per_step = 2N (each engine fills about 1.8 groups of 16 a step).

For each (engines, gateways) of the sweep, a fresh stack: warm-up until the learner took two
steps, then a window: throughput (turns, episodes, trajectories trained per second), CPU of each
process (CPU-ms per turn and per episode), Redis commands, microseconds per call and bytes per
episode, admission waits per group, consumer-group pending and lag, staleness of what was
trained. Offered load = N x 64 slots / the profile's mean turn time; a point is saturated when it
reaches less than 80% of it. The gateways' own view of the fakes' latency (exec: 3.7 ms, create:
45 ms at the fake) shows how late their event loops answer. Then the extrapolated table (control_plane_report.py).
Writes results.json and plots to --out (default .shellrl/benchmarks/control-plane/, so a rerun
never overwrites the committed runs, which were written with --out docs/runs/control-plane);
`--quick` writes into a temporary directory it removes at its end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.control_plane_attribution import attribute
from benchmarks.control_plane_drain import measure_drain
from benchmarks.control_plane_measure import ROLES, Point, measure, wait_warm
from benchmarks.control_plane_report import (
    extrapolate,
    measured,
    offered_turns_per_s,
    per_engine_episodes_per_s,
    plot,
)
from benchmarks.control_plane_stack import Stack, StackConfig, start_stack, write_profile

console = Console(width=200)


def start_warm(config: StackConfig, profile: Path, warm_steps: int, attempts: int = 3) -> Stack:
    """A started stack whose learner took `warm_steps` steps. A process that lost its port to
    another process between the stack's choice and its bind (seen with two test suites beside
    `make bench`: a gateway exited with 'address already in use' during the warm-up, after the
    port's new owner had answered its readiness check) restarts the whole stack with fresh ports,
    `attempts` in all; any other failure is raised at once."""
    for attempt in range(1, attempts + 1):
        stack = start_stack(config, profile)
        try:
            wait_warm(stack, warm_steps, deadline_s=240)
            return stack
        except RuntimeError as exc:
            stack.stop()
            if attempt == attempts or "address already in use" not in str(exc):
                raise
            console.print("[yellow]a process lost its port while warming up: fresh ports[/yellow]")
    raise AssertionError("unreachable")


def run_point(config: StackConfig, profile: Path, window_s: float, warm_steps: int) -> Point:
    console.print(
        f"[dim]engines={config.engines} gateways={config.gateways} "
        f"stream shards={config.stream_shards}: starting[/dim]"
    )
    stack = start_warm(config, profile, warm_steps)
    try:
        return measure(stack, window_s)
    finally:
        stack.stop()


def run_attribution(config: StackConfig, profile: Path, seconds: float) -> Table:
    """Redis commands by process and Lua script, per episode (MONITOR; control_plane_attribution)."""
    stack = start_warm(config, profile, 1)
    try:
        before = _episodes(stack)
        by_role = attribute(stack, seconds)
        episodes = max(_episodes(stack) - before, 1)
    finally:
        stack.stop()
    table = Table(
        title=f"Redis commands per episode by process ({config.engines} engines, "
        f"{config.gateways} gateway(s); MONITOR for {seconds:g} s, {episodes:.0f} episodes)"
    )
    for c in ("process", "commands/episode", "top commands (per episode)"):
        table.add_column(c, justify="left" if c != "commands/episode" else "right")
    for name, counts in sorted(by_role.items(), key=lambda kv: -sum(kv[1].values())):
        top = ", ".join(f"{c} {n / episodes:.2f}" for c, n in counts.most_common(8))
        table.add_row(name, f"{sum(counts.values()) / episodes:.1f}", top)
    return table


def _episodes(stack: Stack) -> float:
    from benchmarks.control_plane_probe import prometheus

    return sum(
        v
        for url in stack.gateway_urls
        for k, v in prometheus(url).items()
        if k.startswith("shellrl_rollout_episodes_total{")
    )


def points_table(points: list[Point], profile: dict) -> Table:
    table = Table(title="Control plane: measured points (2-core VM; all processes on it)")
    cols = ["engines", "gateways", "turns/s", "offered", "episodes/s", "trained/s", "steps"]
    cols += [f"{r} cores" for r in ROLES] + ["machine cores", "load avg"]
    for c in cols:
        table.add_column(c, justify="right")
    for p in points:
        table.add_row(
            str(p.engines),
            str(p.gateways),
            f"{p.turns_per_s:.0f}",
            f"{offered_turns_per_s(profile, p.engines):.0f}",
            f"{p.episodes_per_s:.1f}",
            f"{p.trained_per_s:.1f}",
            str(p.steps),
            *(f"{p.cpu_cores.get(r, 0):.2f}" for r in ROLES),
            f"{p.machine_cores_used:.2f}",
            f"{p.loadavg[0]:.1f}",
        )
    return table


def costs_table(points: list[Point]) -> Table:
    table = Table(title="Cost per episode (CPU ms; Redis commands and bytes) and latency signals")
    cols = [f"{r} ms/ep" for r in ROLES if r != "fakes"] + ["gateways ms/turn", "redis cmds/ep"]
    cols += ["evalsha/ep", "evalsha us", "in B/ep", "out B/ep", "mem B/ep", "keys/ep"]
    cols += ["adm. wait s/group"]
    cols += ["groups/s", "exec ms", "create ms", "verifier pending", "learner pending"]
    cols += ["staleness 0/1/2+"]
    table.add_column("engines x gw", justify="right")
    for c in cols:
        table.add_column(c, justify="right")
    for p in points:
        stale = p.staleness
        total = max(sum(stale.values()), 1)
        s2 = sum(v for k, v in stale.items() if k >= 2)
        waits = ", ".join(
            f"{k} {v:.2f}" for k, v in p.admission_wait_s_per_group.items() if v > 0.005
        )
        table.add_row(
            _label(p),
            *(measured(p.ms_per_episode.get(r, 0), ".2f") for r in ROLES if r != "fakes"),
            measured(p.ms_per_turn.get("gateways", 0), ".2f"),
            f"{sum(p.redis_calls_per_episode.values()):.1f}",
            f"{p.redis_calls_per_episode.get('evalsha', 0):.2f}",
            f"{p.redis_usec_per_call.get('evalsha', 0):.0f}",
            f"{p.redis_in_bytes_per_episode:.0f}",
            f"{p.redis_out_bytes_per_episode:.0f}",
            f"{p.redis_memory_bytes_per_episode:.0f}",
            f"{p.redis_keys_per_episode:.2f}",
            waits or "-",
            f"{p.groups_admitted_per_s:.1f}",
            f"{p.call_ms.get('exec', 0):.0f}",
            f"{p.call_ms.get('session_create', 0):.0f}",
            f"{p.lag.get('verifier', {}).get('pending_mean', 0):.0f}",
            f"{p.lag.get('learner', {}).get('pending_mean', 0):.0f}",
            f"{stale.get(0, 0) / total:.2f}/{stale.get(1, 0) / total:.2f}/{s2 / total:.2f}",
        )
    return table


def memory_table(points: list[Point]) -> Table:
    table = Table(title="What an episode leaves in Redis (keys per episode, bytes each, TTL)")
    table.add_column("engines x gw", justify="right")
    kinds = sorted({k for p in points for k in p.retained})
    for kind in kinds:
        table.add_column(f"{kind}: per ep / B / TTL s", justify="right")
    for p in points:
        cells = []
        for kind in kinds:
            v = p.retained.get(kind)
            ttl = "kept" if v and v["ttl_s"] < 0 else f"{v['ttl_s']:.0f}" if v else "-"
            cells.append(
                f"{v['keys_per_episode']:.2f} / {v['bytes_per_key']:.0f} / {ttl}" if v else "-"
            )
        table.add_row(_label(p), *cells)
    return table


def _label(p: Point) -> str:
    """ "engines x gateways", and " + S shards" with stream shards."""
    shards = f" + {p.stream_shards} shards" if p.stream_shards else ""
    return f"{p.engines} x {p.gateways}{shards}"


def shards_table(points: list[Point], profile: dict) -> Table:
    """Each Redis process's CPU per episode, and how many engines the busiest one carries at
    70% of one core at that cost (this point's cost, not the slope over a sweep)."""
    per_engine = per_engine_episodes_per_s(profile)
    table = Table(
        title="Redis instances: CPU ms per episode (the control Redis and the stream shards)"
    )
    cols = ["engines x gw", "episodes/s", "control ms/ep", "shards ms/ep (each)"]
    cols += ["all Redis ms/ep", "busiest ms/ep", "engines at 70% of its core"]
    for c in cols:
        table.add_column(c, justify="right")
    for p in points:
        per = p.redis_instance_ms_per_episode
        control = per.get("redis", math.nan)
        shards = [v for k, v in sorted(per.items()) if k != "redis"]
        busiest = max(per.values(), default=math.nan)
        table.add_row(
            _label(p),
            f"{p.episodes_per_s:.1f}",
            measured(control, ".2f"),
            " / ".join(measured(v, ".2f") for v in shards) or "-",
            measured(sum(per.values()), ".2f"),
            measured(busiest, ".2f"),
            f"{700 / (busiest * per_engine):.0f}" if busiest > 0 else "-",
        )
    return table


def extrapolated_table(rows: list[dict]) -> Table:
    table = Table(title="Extrapolated from the per-episode costs (see BENCHMARKS.md for the rule)")
    for c in rows[0]:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_control_plane", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--warm-steps", type=int, default=1)
    parser.add_argument(
        "--attribute-engines",
        type=int,
        default=0,
        help="engines of the stack whose Redis commands are attributed by MONITOR (0: skip)",
    )
    parser.add_argument(
        "--drain-engines",
        type=int,
        default=32,
        help="engines of the stack whose learner intake drains a backlog (0: skip)",
    )
    parser.add_argument(
        "--trajectories-maxlen",
        type=int,
        help="the verifier's SHELLRL_TRAJECTORIES_STREAM_MAXLEN (default: its own)",
    )
    parser.add_argument(
        "--stream-shards",
        type=int,
        nargs="+",
        default=[0],
        help="Redis instances holding the training streams beside the control one "
        "(SHELLRL_STREAM_SHARD_URLS; shellrl/streams/shards.py), one sweep each (default: 0)",
    )
    parser.add_argument("--out", type=Path, default=REPO / ".shellrl/benchmarks/control-plane")
    parser.add_argument(
        "--from-results",
        type=Path,
        help="print the tables and plots of an earlier run's results.json (runs nothing)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 engines x 1 gateway, 3 s window, without and with one stream shard "
        "(unless --stream-shards is given)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.engines, args.gateways, args.window_s, args.warm_steps = [2], [1], 3.0, 1
        args.attribute_engines = args.drain_engines = 0
        if args.stream_shards == [0]:  # the default: the sharded data path runs too
            args.stream_shards = [0, 1]
        console.print(
            "quick form: a check that the harness runs (2 engines, a 3 s window); its costs per "
            "episode and its extrapolation are not results (the full sweep's are in BENCHMARKS.md)"
        )
        with tempfile.TemporaryDirectory(prefix="bench-cp-quick-") as out:
            args.out = Path(out)
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]Control plane[/bold] on {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}"
    )
    if args.from_results:
        body = json.loads(args.from_results.read_text())
        points = [Point.from_json(p) for p in body["points"]]
        report(points, body["profile"], args.from_results.parent, body.get("drain"))
        return
    profile_path = write_profile(args.out)  # kept beside results.json
    profile = json.loads(profile_path.read_text())
    points: list[Point] = []
    sweeps = [(s, g, e) for s in args.stream_shards for g in args.gateways for e in args.engines]
    for shards, gateways, engines in sweeps:
        if gateways > 1 and engines < 16:
            continue  # one gateway carries these with room to spare
        config = StackConfig(
            engines=engines,
            gateways=gateways,
            trajectories_maxlen=args.trajectories_maxlen,
            stream_shards=shards,
        )
        points.append(run_point(config, profile_path, args.window_s, args.warm_steps))
        (args.out / "results.json").write_text(
            json.dumps({"profile": profile, "points": [p.to_json() for p in points]}, indent=1)
        )
    if args.attribute_engines:
        config = StackConfig(engines=args.attribute_engines)
        console.print(run_attribution(config, profile_path, seconds=3.0))
    drain = None
    if args.drain_engines:
        drain = measure_drain(StackConfig(engines=args.drain_engines), profile_path)
    report(points, profile, args.out, drain)


def report(points: list[Point], profile: dict, out: Path, drain: dict | None = None) -> None:
    """Print every table, write the plots and results.json (with the extrapolation) to `out`."""
    if drain:
        console.print(
            f"Learner intake drain: {drain['trajectories']} trajectories waiting "
            f"({drain['engines']} engines' admission bound) taken in {drain['seconds']:.1f} s: "
            f"{drain['trajectories_per_s']:.0f} trajectories/s, "
            f"{drain['ms_per_trajectory']:.2f} CPU-ms each"
        )
    console.print(points_table(points, profile))
    console.print(costs_table(points))
    console.print(memory_table(points))
    console.print(shards_table(points, profile))
    # the extrapolation's slopes: the sweep without stream shards (when it ran)
    unsharded = [p for p in points if not p.stream_shards] or points
    rows, basis = extrapolate(unsharded, profile, drain)
    console.print(
        "CPU-ms per episode (slope over the 1-gateway points; learner: "
        + ("the drain's" if drain else "the sweep's, no drain run")
        + "): "
        + ", ".join(f"{r} {measured(v, '.2f')}" for r, v in basis["ms_per_episode"].items())
        + f"; one engine offers {basis['episodes_per_s_per_engine']:.1f} episodes/s; one process "
        "at 70% of a core carries: "
        + ", ".join(
            f"{r} {'not measured' if n is None else f'{n:.0f} engines'}"
            for r, n in basis["single_process_limit_engines"].items()
        )
    )
    console.print(extrapolated_table(rows))
    console.print(f"plots: {', '.join(str(p) for p in plot(points, profile, out))}")
    (out / "results.json").write_text(
        json.dumps(
            {
                "profile": profile,
                "points": [p.to_json() for p in points],
                "extrapolated": rows,
                "basis": basis,
                "drain": drain,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
