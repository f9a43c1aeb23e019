"""The experiments as data: which settings each point changes, which tasks run, for how long.

* concurrency: 1/4/8/16 environments (the sandbox's `max_sessions`: concurrent episodes), every
  episode 10 s; groups of 2, 4 groups per learner step, max_staleness 3 (the admission bound,
  16 groups = 32 episodes ahead of the learner, never caps the sweep).
* long-tail: per learner step 8 groups of 2, 7 groups whose episodes take 10 s and one whose
  take 80 s (one task of 8 per epoch of the pool); 16 episodes in flight at most. Batch barrier
  = max_staleness 0 (admit a step's groups, wait for the step); continuous admission =
  max_staleness k with the strict bound (services/rollout/admission.py), and (full form) with
  the plain bound.
* staleness: sync (max_staleness 0) vs async k = 1, 2, 4; groups of 2, 2 groups per step,
  episodes of 5 to 15 s (8 tasks, evenly spread); in-flight cap 20 episodes, which k = 4 fills.

Durations are base seconds times `scale` (0.1 on the CPU by default: 1 s and 8 s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NAMES = ("concurrency", "long-tail", "staleness")
GROUP_SIZE = 2  # the smallest group with a baseline (services/rollout/admission.py, MIN_USABLE)


@dataclass(frozen=True)
class Point:
    """One setting of an experiment. service_env: service -> SHELLRL_* it sets; slots: the
    episode slots the point offers (environments, or the in-flight cap), the denominator of
    slot utilisation."""

    name: str
    service_env: dict[str, dict[str, str]]
    slots: int


@dataclass(frozen=True)
class Experiment:
    """name: one of NAMES; title: the workload in words (table title); env: SHELLRL_* of every
    service; tasks: REST bodies of POST /v1/tasks; window_s: measuring time of each point."""

    name: str
    title: str
    points: tuple[Point, ...]
    tasks: tuple[dict, ...]
    env: dict[str, str]
    window_s: float
    scale: float
    meta: dict = field(default_factory=dict)


def delay_task(task_id: str, delay_s: float) -> dict:
    """A training task whose setup sleeps `delay_s` seconds in the episode's sandbox session,
    one turn, scored by its answer (the tiny model never gives it: reward 0)."""
    return {
        "task_id": task_id,
        "instruction": "Wait for the setup, then answer with the number 1.",
        "setup": f"sleep {delay_s:.3f}",
        "check": {"type": "answer_equals", "expected": "1"},
        "split": "train",
        "max_turns": 1,
    }


def common_env(
    group_size: int, groups_per_step: int, max_delay_s: float, max_new_tokens: int
) -> dict[str, str]:
    """Settings every point of every experiment shares."""
    return {
        "SHELLRL_GROUP_SIZE": str(group_size),
        "SHELLRL_GROUPS_PER_STEP": str(groups_per_step),
        "SHELLRL_MAX_NEW_TOKENS": str(max_new_tokens),
        "SHELLRL_MAX_TURNS": "1",
        "SHELLRL_TRAIN_ZERO_VARIANCE_GROUPS": "true",
        "SHELLRL_SANDBOX_BUSY_POLL_S": "0.05",
        "SHELLRL_SETUP_TIMEOUT_S": f"{max_delay_s + 60:.0f}",
        "SHELLRL_EPISODE_TIMEOUT_S": f"{2 * max_delay_s + 120:.0f}",
        "SHELLRL_CHECKPOINT_INTERVAL_STEPS": "1000000",
        # the gateway's terminal-health gate (slows new groups on a loaded host) stays off: the
        # experiments compare admission policies on a shared 2-core machine, not its load
        "SHELLRL_SANDBOX_HEALTH_THRESHOLD": "0",
        "SHELLRL_LOG_LEVEL": "WARNING",
    }


def _point(name: str, slots: int, *, sessions: int, in_flight: int, **learner_and_rollout) -> Point:
    shared = {k: str(v) for k, v in learner_and_rollout.items()}
    return Point(
        name,
        {
            "sandbox": {"SHELLRL_MAX_SESSIONS": str(sessions)},
            "rollout": {"SHELLRL_MAX_EPISODES_IN_FLIGHT": str(in_flight), **shared},
            "learner": dict(shared),
        },
        slots,
    )


def concurrency(
    scale: float, window_s: float, levels=(1, 4, 8, 16), max_new_tokens: int = 8
) -> Experiment:
    delay = 10 * scale
    points = tuple(
        _point(
            f"{n} environment{'s' if n > 1 else ''}",
            n,
            sessions=n,
            in_flight=max(n, GROUP_SIZE),
            SHELLRL_MAX_STALENESS=3,
        )
        for n in levels
    )
    return Experiment(
        "concurrency",
        f"Concurrency sweep: episodes of {delay:g} s (10 s x {scale:g}), groups of {GROUP_SIZE}, "
        f"4 groups per step, max_staleness 3; {window_s:g} s per point",
        points,
        tuple(delay_task(f"conc-{i}", delay) for i in range(8)),
        common_env(GROUP_SIZE, 4, delay, max_new_tokens),
        window_s,
        scale,
        {"episode_s": delay, "levels": list(levels)},
    )


def long_tail(
    scale: float, window_s: float, k: int = 2, plain: bool = True, max_new_tokens: int = 8
) -> Experiment:
    short, long = 10 * scale, 80 * scale
    cap = 8 * GROUP_SIZE
    options = {"sessions": 2 * cap, "in_flight": cap}
    points = [
        _point("batch barrier (k=0)", cap, **options, SHELLRL_MAX_STALENESS=0),
        _point(
            f"continuous, strict bound (k={k})",
            cap,
            **options,
            SHELLRL_MAX_STALENESS=k,
            SHELLRL_STRICT_STALENESS="true",
        ),
    ]
    if plain:
        points.append(
            _point(
                f"continuous, plain bound (k={k})",
                cap,
                **options,
                SHELLRL_MAX_STALENESS=k,
                SHELLRL_STRICT_STALENESS="false",
            )
        )
    tasks = [delay_task("tail-long", long)] + [delay_task(f"tail-{i}", short) for i in range(7)]
    return Experiment(
        "long-tail",
        f"Long tail: per step 8 groups of {GROUP_SIZE}, 7 with episodes of {short:g} s and one of "
        f"{long:g} s (10 s / 80 s x {scale:g}); {cap} episodes in flight; {window_s:g} s per point",
        tuple(points),
        tuple(tasks),
        common_env(GROUP_SIZE, 8, long, max_new_tokens),
        window_s,
        scale,
        {"short_s": short, "long_s": long, "k": k},
    )


def staleness(
    scale: float, window_s: float, ks=(0, 1, 2, 4), max_new_tokens: int = 8
) -> Experiment:
    groups_per_step = 2
    cap = GROUP_SIZE * groups_per_step * (max(ks) + 1)
    delays = [10 * scale * (0.5 + i / 7) for i in range(8)]
    points = tuple(
        _point(
            "sync (k=0)" if k == 0 else f"async k={k}",
            cap,
            sessions=2 * cap,
            in_flight=cap,
            SHELLRL_MAX_STALENESS=k,
        )
        for k in ks
    )
    return Experiment(
        "staleness",
        f"Staleness sweep: groups of {GROUP_SIZE}, {groups_per_step} groups per step, episodes of "
        f"{delays[0]:g} to {delays[-1]:g} s (5-15 s x {scale:g}); {cap} episodes in flight at "
        f"most; {window_s:g} s per point",
        points,
        tuple(delay_task(f"stale-{i}", d) for i, d in enumerate(delays)),
        common_env(GROUP_SIZE, groups_per_step, max(delays), max_new_tokens),
        window_s,
        scale,
        {"episode_s": delays, "ks": list(ks)},
    )


def build(
    name: str,
    *,
    scale: float,
    quick: bool,
    window_s: float | None = None,
    levels: tuple[int, ...] | None = None,
    ks: tuple[int, ...] | None = None,
) -> Experiment:
    """The experiment `name` (one of NAMES) in its full or quick form; `window_s` overrides the
    form's measuring time per point, `levels` the concurrency levels, `ks` the staleness bounds.
    Raises ValueError for an unknown name or a level < 1 or k < 0."""
    if levels is not None and min(levels) < 1:
        raise ValueError(f"concurrency levels must be >= 1, got {list(levels)}")
    if ks is not None and min(ks) < 0:
        raise ValueError(f"max_staleness values must be >= 0, got {list(ks)}")
    if name == "concurrency":
        return concurrency(scale, window_s or (30.0 if quick else 60.0), levels or (1, 4, 8, 16))
    if name == "long-tail":
        return long_tail(scale, window_s or (30.0 if quick else 90.0), plain=not quick)
    if name == "staleness":
        ks = ks or ((0, 1, 4) if quick else (0, 1, 2, 4))
        return staleness(scale, window_s or (25.0 if quick else 60.0), ks)
    raise ValueError(f"unknown experiment {name!r}; expected one of {', '.join(NAMES)}")
