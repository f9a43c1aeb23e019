"""The control-plane benchmark's offered load, extrapolation and plots.

Offered load of N simulated engines: every engine keeps `slots` (64) episodes busy, an episode
spends a turn's mean generate + exec and its session create once (the profile's means), so
    offered turns/s = N x slots / (generate + exec + create / turns_per_episode).
A measured point is saturated when it reaches less than SATURATED of its offered load.

Extrapolation: each engine offers its slots-full rate (above: what real engines produce when the
control plane keeps up, not what this machine reached); each shared part costs its marginal
CPU-ms per episode, the slope of its CPU against episodes/s over the one-gateway points
(`marginal_ms_per_episode`). Sizing rules: a gateway or verifier
replica is one Python process, planned at PLAN_UTILISATION of a core; Redis executes commands
on one thread, so its CPU is given in % of one core (past PLAN_UTILISATION: shard); the learner's
intake is one process on rank 0 (its core share, same rule).
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.control_plane_measure import ROLES, Point
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


def marginal_ms_per_episode(points: list[Point]) -> dict[str, float]:
    """Per role, the slope of CPU cores against episodes/s over the measured points (least
    squares): CPU-ms one more episode costs, without the fixed cost of idle loops and polls
    (which the per-episode figure of a slow point includes). Falls back to the fastest point's
    per-episode figure when fewer than 3 points differ in rate."""
    import numpy as np

    rates = np.array([p.episodes_per_s for p in points])
    fastest = max(points, key=lambda p: p.episodes_per_s)
    out = {}
    for r in ROLES:
        cores = np.array([p.cpu_cores.get(r, 0.0) for p in points])
        if len(set(rates.round(1))) >= 3:
            slope = float(np.polyfit(rates, cores, 1)[0])
            out[r] = 1000 * slope if slope > 0 else fastest.ms_per_episode[r]
        else:
            out[r] = fastest.ms_per_episode[r]
    return out


def per_engine_episodes_per_s(profile: dict) -> float:
    """What one engine offers with every slot busy (module docstring), in episodes/s."""
    return offered_turns_per_s(profile, 1) / profile["sources"]["turns_per_episode"]


def extrapolate(
    points: list[Point], profile: dict, drain: dict | None = None
) -> tuple[list[dict], dict]:
    """Rows of the sizing table, and the numbers they come from (`basis`). With a `drain`
    measurement (control_plane_drain.py) the learner intake costs what it cost draining."""
    one = [p for p in points if p.gateways == 1] or points
    ms = marginal_ms_per_episode(one)
    if drain:
        ms["learner"] = drain["ms_per_trajectory"]
    fastest = max(points, key=lambda p: p.episodes_per_s)
    per_engine = per_engine_episodes_per_s(profile)
    turns_per_episode = (
        fastest.turns_per_s / fastest.episodes_per_s if fastest.episodes_per_s > 0 else math.nan
    )
    lua_per_episode = fastest.redis_calls_per_episode.get("evalsha", 0.0)
    retained = {
        kind: v["keys_per_episode"] * v["bytes_per_key"] * v["ttl_s"]
        for kind, v in fastest.retained.items()
        if v["ttl_s"] > 0
    }  # byte-seconds per episode: x episodes/s = bytes held in steady state
    caps = stream_caps()
    stream_bytes = {}  # per episode appended, and the bytes trimming keeps (None: never trimmed)
    for kind, v in fastest.retained.items():
        if v["ttl_s"] < 0 and kind in caps:
            cap = caps[kind]
            per_episode = v["keys_per_episode"] * v["bytes_per_key"]
            stream_bytes[kind] = (per_episode, None if cap is None else cap * v["bytes_per_key"])
    basis = {
        "retained_byte_seconds_per_episode": retained,
        "stream_bytes_per_episode_and_cap": stream_bytes,
        "ms_per_episode": ms,
        "episodes_per_s_per_engine": per_engine,
        "turns_per_episode": turns_per_episode,
        "redis_in_bytes_per_episode": fastest.redis_in_bytes_per_episode,
        "lua_calls_per_episode": lua_per_episode,
        "measured_up_to_episodes_per_s": fastest.episodes_per_s,
        "single_process_limit_engines": {
            r: single_process_limit_engines(ms[r], per_engine) for r in ("redis", "learner")
        },
    }
    rows = []
    for n in CLUSTER_SIZES:
        episodes = n * per_engine
        cores = {r: episodes * ms[r] / 1000 for r in ROLES}
        rows.append(
            {
                "engines": n,
                "numbers": "measured" if episodes <= fastest.episodes_per_s else "extrapolated",
                "turns/s": measured(episodes * turns_per_episode, ",.0f"),
                "episodes/s": f"{episodes:,.0f}",
                "gateway cores": measured(cores["gateways"], ".1f"),
                "gateway replicas": replicas(cores["gateways"]),
                "Redis CPU % of 1 core": measured(100 * cores["redis"], ".0f"),
                "Redis in MB/s": f"{episodes * fastest.redis_in_bytes_per_episode / 1e6:.1f}",
                "Redis GB held by TTL keys": f"{episodes * sum(retained.values()) / 1e9:,.1f}",
                "Redis GB in streams after a day": f"{_streams_after(episodes, stream_bytes, DAY_S) / 1e9:,.1f}",
                "Lua calls/s": f"{episodes * lua_per_episode:,.0f}",
                "verifier replicas": replicas(cores["verifier"]),
                "learner intake % of 1 core": measured(100 * cores["learner"], ".0f"),
            }
        )
    return rows, basis


DAY_S = 86_400.0
NOT_MEASURED = "-"


def measured(value: float, spec: str) -> str:
    """`value` formatted with `spec`, or NOT_MEASURED for NaN (a cost no window measured:
    control_plane_measure.per_unit_ms)."""
    return NOT_MEASURED if math.isnan(value) else f"{value:{spec}}"


def replicas(cores: float) -> int | str:
    """Processes at PLAN_UTILISATION of a core that carry `cores`, or NOT_MEASURED (NaN)."""
    return NOT_MEASURED if math.isnan(cores) else math.ceil(cores / PLAN_UTILISATION)


def single_process_limit_engines(ms_per_episode: float, per_engine: float) -> float | None:
    """Engines one process at PLAN_UTILISATION of a core carries, or None when the measured cost
    is 0 CPU-ms (a quick run's window can end before the process used one tick of CPU time: no
    measurement, not an unbounded limit) or NaN (no episode finished in the window)."""
    if not (ms_per_episode > 0 and per_engine > 0):  # NaN compares False
        return None
    return PLAN_UTILISATION * 1000 / (ms_per_episode * per_engine)


def stream_caps() -> dict[str, float | None]:
    """Entries each trajectory stream is trimmed to by the code this runs with (None: never)."""
    from services.rollout.settings import RolloutSettings
    from services.verifier.settings import VerifierSettings

    verifier = VerifierSettings.model_fields.get("trajectories_stream_maxlen")
    return {
        "shellrl:episodes": RolloutSettings.model_fields["episodes_stream_maxlen"].default,
        "shellrl:trajectories": verifier.default if verifier else None,
    }


def _streams_after(episodes_per_s: float, stream_bytes: dict, seconds: float) -> float:
    total = 0.0
    for per_episode, cap_bytes in stream_bytes.values():
        grown = episodes_per_s * per_episode * seconds
        total += grown if cap_bytes is None else min(grown, cap_bytes)
    return total


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
    return sum(k * v for k, v in p.staleness.items()) / total if total else float("nan")
