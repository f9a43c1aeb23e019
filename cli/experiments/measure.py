"""What one point of an experiment measured, and its summary.

Inputs, all taken at the end of the point's window:
* the learner's step ledger (`<checkpoint dir>/steps.jsonl`, services/learner/worker.py): per
  step `finished_at` (Unix s), `tokens` (loss tokens trained), `trajectories`, `reward_mean`,
  `staleness_mean`, `staleness_max`;
* the episodes the gateway published (`shellrl:episodes`): `created_at`, `finished_at` (Unix s,
  episode start and end: the sandbox session with its setup, the turns), `failure`;
* the learner's `shellrl_trajectories_dropped_total` by reason (its /metrics);
* the gateway's seconds of episodes waiting for an environment (the sandbox full: 429), the
  `_sum` of `shellrl_rollout_admission_wait_seconds{reason="sandbox_busy"}` (its /metrics).

Times are seconds since the point's tasks were submitted (`t0`); a step or episode counts when it
ended within the window.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

NAN = float("nan")


@dataclass(frozen=True)
class StepRecord:
    """One learner step. wall_s: s since t0 at its end; tokens: loss tokens it trained."""

    wall_s: float
    tokens: int
    trajectories: int
    reward_mean: float
    staleness_mean: float  # NaN: the step trained nothing
    staleness_max: float


@dataclass(frozen=True)
class EpisodeRecord:
    """One published episode: start and end in s since t0; failure: '' or the Failure name."""

    start_s: float
    end_s: float
    failure: str = ""


@dataclass(frozen=True)
class PointResult:
    """Everything a point measured. slots: episode slots it offered (utilisation's denominator);
    dropped: trajectories the learner did not train, by reason; environment_wait_s: episode-
    seconds spent waiting for an environment (not busy); start_s: seconds its services took to
    start (the stack, or the restart of all but Redis and the engine)."""

    name: str
    settings: dict[str, dict[str, str]]
    slots: int
    window_s: float
    steps: tuple[StepRecord, ...]
    episodes: tuple[EpisodeRecord, ...]
    dropped: dict[str, float]
    environment_wait_s: float = 0.0
    start_s: float = 0.0


def steps_from_ledger(records: list[dict], t0: float) -> list[StepRecord]:
    """The ledger's step records (not its events; the last record of a step wins) in step order."""
    by_step = {r["step"]: r for r in records if "step" in r and "event" not in r}
    out = []
    for step in sorted(by_step):
        r = by_step[step]
        out.append(
            StepRecord(
                wall_s=float(r["finished_at"]) - t0,
                tokens=int(r.get("tokens") or 0),
                trajectories=int(r.get("trajectories") or 0),
                reward_mean=float(r.get("reward_mean", NAN)),
                staleness_mean=float(r.get("staleness_mean", NAN)),
                staleness_max=float(r.get("staleness_max", NAN)),
            )
        )
    return out


def read_ledger(path: Path) -> list[dict]:
    """The JSON lines of a step ledger; [] when there is none (no step yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def in_window(point: PointResult) -> tuple[list[StepRecord], list[EpisodeRecord]]:
    """The steps and episodes that ended within [0, window_s]."""
    w = point.window_s
    return (
        [s for s in point.steps if s.wall_s <= w],
        [e for e in point.episodes if e.end_s <= w],
    )


def cumulative_tokens(steps: list[StepRecord]) -> list[int]:
    """Loss tokens trained by the end of each step."""
    total, out = 0, []
    for s in steps:
        total += s.tokens
        out.append(total)
    return out


def busy_s(episodes: list[EpisodeRecord], window_s: float) -> float:
    """Episode-seconds spent inside [0, window_s] (episodes still running at its end included)."""
    return sum(max(0.0, min(e.end_s, window_s) - max(e.start_s, 0.0)) for e in episodes)


def summarize(point: PointResult) -> dict:
    """The table's numbers of one point: episodes/min, learner steps, trained tokens, tokens/s,
    slot utilisation (episode-seconds inside the window, less those spent waiting for an
    environment, / (slots x window)), mean episode s, staleness of the
    trained trajectories (mean weighted by trajectories, max), dropped as stale, INFRA failures."""
    steps, episodes = in_window(point)
    w = point.window_s
    tokens = sum(s.tokens for s in steps)
    trained = [s for s in steps if s.trajectories and math.isfinite(s.staleness_mean)]
    weight = sum(s.trajectories for s in trained)
    return {
        "episodes": len(episodes),
        "episodes_per_min": 60 * len(episodes) / w if w > 0 else NAN,
        "learner_steps": len(steps),
        "trained_tokens": tokens,
        "tokens_per_s": tokens / w if w > 0 else NAN,
        "utilisation": (
            (busy_s(list(point.episodes), w) - point.environment_wait_s) / (point.slots * w)
            if w > 0
            else NAN
        ),
        "episode_s_mean": (
            sum(e.end_s - e.start_s for e in episodes) / len(episodes) if episodes else NAN
        ),
        "staleness_mean": (
            sum(s.staleness_mean * s.trajectories for s in trained) / weight if weight else NAN
        ),
        "staleness_max": max((s.staleness_max for s in trained), default=NAN),
        "dropped_stale": point.dropped.get("stale", 0.0),
        "failures": sum(1 for e in episodes if e.failure),
    }
