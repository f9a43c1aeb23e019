"""The control-plane benchmark's offered load, extrapolation and plots.

Offered load of N simulated engines: every engine keeps `slots` (64) episodes busy, an episode
spends a turn's mean generate + exec and its session create once (the profile's means), so
    offered turns/s = N x slots / (generate + exec + create / turns_per_episode).
A measured point is saturated when it reaches less than SATURATED of its offered load.

Extrapolation from one reference point (the largest unsaturated one with one gateway, else the
fastest): each engine produces the reference's episodes per second per engine; each shared part
costs the reference's CPU-ms per episode (gateways: per turn). Sizing rules: a gateway or verifier
replica is one Python process, planned at PLAN_UTILISATION of a core; Redis executes commands
on one thread, so its CPU is given in % of one core (past PLAN_UTILISATION: shard); the learner's
intake is one process on rank 0 (its core share, same rule).
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.control_plane_measure import Point
from tests.fakes.fake_latency import Distribution

SATURATED = 0.8
PLAN_UTILISATION = 0.7
CLUSTER_SIZES = (16, 64, 256, 1024)


def _mean(profile: dict, key: str) -> float:
    return Distribution.from_json(profile[key]).mean()


def offered_turns_per_s(profile: dict, engines: int) -> float:
    turns_per_episode = profile["sources"]["turns_per_episode"]
    turn_s = (
        _mean(profile, "generate_s")
        + _mean(profile, "exec_s")
        + _mean(profile, "create_s") / turns_per_episode
    )
    return engines * profile["slots"] / turn_s


def saturated(point: Point, profile: dict) -> bool:
    return point.turns_per_s < SATURATED * offered_turns_per_s(profile, point.engines)


def reference(points: list[Point], profile: dict) -> Point:
    fine = [p for p in points if not saturated(p, profile)]
    if fine:
        return max(fine, key=lambda p: (p.engines, -p.gateways))
    return max(points, key=lambda p: p.turns_per_s)


def extrapolate(ref: Point, profile: dict) -> list[dict]:
    per_engine = ref.episodes_per_s / ref.engines
    turns_per_episode = ref.turns_per_s / max(ref.episodes_per_s, 1e-9)
    rows = []
    for n in CLUSTER_SIZES:
        episodes = n * per_engine
        turns = episodes * turns_per_episode
        gw = turns * ref.ms_per_turn["gateways"] / 1000
        verifier = episodes * ref.ms_per_episode["verifier"] / 1000
        learner = episodes * ref.ms_per_episode["learner"] / 1000
        redis_pct = 100 * episodes * ref.ms_per_episode["redis"] / 1000
        rows.append(
            {
                "engines": n,
                "numbers": "measured" if n <= ref.engines else "extrapolated",
                "turns/s": f"{turns:,.0f}",
                "episodes/s": f"{episodes:,.0f}",
                "gateway cores": f"{gw:.1f}",
                "gateway replicas": math.ceil(gw / PLAN_UTILISATION),
                "Redis CPU % of 1 core": f"{redis_pct:.0f}",
                "Redis in MB/s": f"{episodes * ref.redis_in_bytes_per_episode / 1e6:.1f}",
                "Lua calls/s": f"{episodes * ref.redis_calls_per_episode.get('evalsha', 0):,.0f}",
                "verifier replicas": math.ceil(verifier / PLAN_UTILISATION),
                "learner intake cores": f"{learner:.2f}",
            }
        )
    return rows


def plot(points: list[Point], profile: dict, out: Path) -> list[Path]:
    """control_plane.png: throughput, CPU by process, consumer-group pending, admission wait and
    staleness, each against engines (one line per gateway count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    by_gw: dict[int, list[Point]] = {}
    for p in sorted(points, key=lambda p: p.engines):
        by_gw.setdefault(p.gateways, []).append(p)
    ax = axes[0][0]
    xs_all = sorted({p.engines for p in points})
    ax.plot(xs_all, [offered_turns_per_s(profile, n) for n in xs_all], "k--", label="offered")
    for gw, ps in by_gw.items():
        ax.plot(
            [p.engines for p in ps], [p.turns_per_s for p in ps], "o-", label=f"{gw} gateway(s)"
        )
    ax.set(title="turns/s", xlabel="simulated engines", xscale="log", yscale="log")
    ax.legend()
    ax = axes[0][1]
    for gw, ps in by_gw.items():
        style = "o-" if gw == min(by_gw) else "s:"
        for role in ("gateways", "verifier", "learner", "redis", "fakes"):
            ax.plot([p.engines for p in ps], [p.cpu_cores.get(role, 0) for p in ps], style,
                    label=f"{role} ({gw} gw)")  # fmt: skip
    ax.axhline(2, color="k", lw=0.5)
    ax.set(title="CPU cores by process (machine: 2)", xlabel="simulated engines", xscale="log")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1][0]
    for gw, ps in by_gw.items():
        for group in ("verifier", "learner"):
            ax.plot([p.engines for p in ps],
                    [p.lag.get(group, {}).get("pending_mean", 0) for p in ps], "o-",
                    label=f"{group} pending ({gw} gw)")  # fmt: skip
    ax.set(title="stream entries pending (mean)", xlabel="simulated engines", xscale="log")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for gw, ps in by_gw.items():
        ax.plot([p.engines for p in ps],
                [sum(p.admission_wait_s_per_group.values()) for p in ps], "o-",
                label=f"admission wait s/group ({gw} gw)")  # fmt: skip
        ax.plot([p.engines for p in ps], [_mean_staleness(p) for p in ps], "s:",
                label=f"mean staleness, versions ({gw} gw)")  # fmt: skip
    ax.set(title="admission wait and staleness", xlabel="simulated engines", xscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "control_plane.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def _mean_staleness(p: Point) -> float:
    total = sum(p.staleness.values())
    return sum(k * v for k, v in p.staleness.items()) / total if total else 0.0
