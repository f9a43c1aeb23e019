"""The control-plane benchmark's extrapolation: marginal costs are the slope of CPU against
episodes/s (the fixed cost of idle loops left out), sizing rows follow from them, and what an
episode leaves in Redis becomes bytes held (TTL keys) or a capped stream."""

from __future__ import annotations

import math

from benchmarks.control_plane_measure import ROLES, Point, per_unit_ms
from benchmarks.control_plane_profile import build_profile
from benchmarks.control_plane_report import (
    NOT_MEASURED,
    extrapolate,
    marginal_ms_per_episode,
    per_engine_episodes_per_s,
)


def point(engines: int, episodes_per_s: float, fixed_cores: float, ms: float) -> Point:
    cores = {r: fixed_cores + episodes_per_s * ms / 1000 for r in ROLES}
    return Point(
        engines=engines,
        gateways=1,
        window_s=20.0,
        turns_per_s=2 * episodes_per_s,
        episodes_per_s=episodes_per_s,
        trained_per_s=episodes_per_s,
        steps=1,
        cpu_cores=cores,
        ms_per_turn={r: 1000 * c / (2 * episodes_per_s) for r, c in cores.items()},
        ms_per_episode={r: 1000 * c / episodes_per_s for r, c in cores.items()},
        redis_calls_per_episode={"evalsha": 3.0},
        redis_usec_per_call={"evalsha": 40.0},
        redis_in_bytes_per_episode=7000.0,
        redis_out_bytes_per_episode=7000.0,
        admission_wait_s_per_group={},
        groups_admitted_per_s=episodes_per_s / 16,
        lag={},
        staleness={1: 10},
        dropped={},
        loadavg=(1.0, 1.0, 1.0),
        retained={
            "idempotency": {"keys_per_episode": 2.0, "bytes_per_key": 100.0, "ttl_s": 3600.0},
            "shellrl:trajectories": {"keys_per_episode": 1.0, "bytes_per_key": 4000.0, "ttl_s": -1},
        },
    )


def test_the_slope_leaves_out_the_fixed_cost_of_idle_loops():
    points = [point(n, 10.0 * n, fixed_cores=0.05, ms=2.0) for n in (1, 4, 16)]
    assert points[0].ms_per_episode["redis"] > 6.0  # 2 ms + 0.05 cores over 10 episodes/s
    assert math.isclose(marginal_ms_per_episode(points)["redis"], 2.0, rel_tol=1e-6)


def test_rows_size_replicas_redis_and_memory_from_the_per_episode_costs():
    profile = build_profile(lambda text: [5] * len(text.split()), 2)
    points = [point(n, 10.0 * n, fixed_cores=0.0, ms=1.0) for n in (1, 4, 16)]
    rows, basis = extrapolate(points, profile, drain={"ms_per_trajectory": 0.5})
    per_engine = per_engine_episodes_per_s(profile)
    row = rows[2]  # 256 engines
    assert row["engines"] == 256 and row["numbers"] == "extrapolated"
    episodes = 256 * per_engine
    assert row["gateway replicas"] == math.ceil(episodes * 1.0 / 1000 / 0.7)
    assert row["Redis CPU % of 1 core"] == f"{100 * episodes / 1000:.0f}"
    assert row["learner intake % of 1 core"] == f"{100 * episodes * 0.5 / 1000:.0f}"
    assert row["Redis GB held by TTL keys"] == f"{episodes * 2 * 100 * 3600 / 1e9:,.1f}"
    assert basis["ms_per_episode"]["learner"] == 0.5


def test_a_process_that_used_no_cpu_tick_in_the_window_has_no_limit_not_a_division_by_zero():
    """CI at 2740dbb: the quick form's learner used 0.00 CPU-ms per episode (under one clock tick
    in a 20 s window) and extrapolate() raised ZeroDivisionError. The limit is unmeasured: None."""
    profile = build_profile(lambda text: [5] * len(text.split()), 2)
    points = [point(n, 10.0 * n, fixed_cores=0.0, ms=1.0) for n in (1, 4, 16)]
    for p in points:
        p.cpu_cores["learner"] = 0.0
        p.ms_per_episode["learner"] = 0.0
    rows, basis = extrapolate(points, profile)
    limits = basis["single_process_limit_engines"]
    assert limits["learner"] is None
    assert math.isclose(limits["redis"], 0.7 * 1000 / (1.0 * per_engine_episodes_per_s(profile)))
    assert rows[2]["learner intake % of 1 core"] == "0"


def test_no_episode_in_the_window_is_not_measured_not_the_window_s_cpu_per_episode():
    """A window with no finished episode gave each role's whole CPU time as its cost per episode
    (n / max(n, 1)); it is NaN, and 3 units share the same CPU out."""
    cores = {"gateways": 0.5, "redis": 0.25}
    ms = per_unit_ms(cores, wall_s=3.0, units=0)
    assert set(ms) == set(ROLES) and all(math.isnan(v) for v in ms.values())
    ms = per_unit_ms(cores, wall_s=3.0, units=3)
    assert ms["gateways"] == 500.0 and ms["redis"] == 250.0 and ms["learner"] == 0.0


def test_points_without_episodes_extrapolate_to_not_measured_rows_not_a_crash():
    """NaN costs (no episode in any window) gave math.ceil(nan) (ValueError) in the replica
    columns and 'nan' or 1e9 turns per episode elsewhere: those cells are NOT_MEASURED, the
    limits None, and what does not depend on the costs stays."""
    profile = build_profile(lambda text: [5] * len(text.split()), 2)
    points = [point(n, 10.0 * n, fixed_cores=0.05, ms=2.0) for n in (1, 4)]
    for p in points:
        p.episodes_per_s = 0.0
        p.ms_per_episode = per_unit_ms(p.cpu_cores, p.window_s, 0)
    rows, basis = extrapolate(points, profile)
    assert all(basis["single_process_limit_engines"][r] is None for r in ("redis", "learner"))
    assert math.isnan(basis["turns_per_episode"])
    for row in rows:
        for column in ("turns/s", "gateway cores", "gateway replicas", "verifier replicas"):
            assert row[column] == NOT_MEASURED, column
        assert row["Redis CPU % of 1 core"] == NOT_MEASURED
        assert row["learner intake % of 1 core"] == NOT_MEASURED
        assert row["episodes/s"] == f"{row['engines'] * per_engine_episodes_per_s(profile):,.0f}"
