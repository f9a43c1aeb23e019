"""Reward components of a real terminal: `safety`, `state_drift`, `time_efficiency` (issue 21).

Each is a penalty in [-8, 0] (never a bonus: a component that can only cost cannot be farmed the
way the +0.1 exit-0 bonus was, feasibility.md: the policy learned to `echo` for it), reported in
`reward_components` under its name and added to `training_reward` times its weight. A weight of
0 (the default of each) turns the component off: it is neither computed nor reported.

  safety           the escalating penalty of safety_escalation.py (-5, or -8 after 100 clean
                   commands) when the sandbox flagged or denied any command of the episode: its
                   text, or with the executed-argv trace any command its shell ran after
                   expansion (a `rm -rf` spelled through a variable is caught there)
  state_drift      -min(1, drifted / drift_max_paths): drifted = paths of the workspace diff
                   against the post-setup snapshot (sandbox GET /v1/sessions/{id}/diff) that are
                   not the task's outputs. Outputs: the paths of its file checks plus `output:`
                   tags (a directory exempts what lies beneath it). Any change of an output is
                   exempt (writing it, and also deleting it: deleting an output never lowers
                   the drift); a directory above an output is exempt only when `added` (made to
                   hold it), never when removed (else deleting a setup directory that holds an
                   output would hide every other file in it)
  time_efficiency  -min(1, max(0, used_s / budget_s - 1)): used_s = the run time of the
                   episode's commands in the sandbox (timed-out ones at their full time);
                   budget_s = the task's `time_budget_s:<s>` tag, else the default. 0 within the
                   budget, -1 at twice the budget or more. Doing nothing scores 0, the same as an
                   efficient success, so it can never make a failure beat a success.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from services.verifier import metrics
from services.verifier.rewards import command_events
from services.verifier.safety_escalation import SafetyEscalation
from shellrl.contract import Task, ToolEvent

OUTPUT_TAG = "output:"
TIME_BUDGET_TAG = "time_budget_s:"
FILE_CHECKS = ("file_exists", "file_contains", "file_sha256")


@dataclass(frozen=True)
class ComponentWeights:
    """Weights of the terminal components in training_reward (0 = off: not computed)."""

    safety: float = 0.0
    state_drift: float = 0.0
    time_efficiency: float = 0.0

    def __post_init__(self) -> None:
        for name, value in self.by_name().items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"ComponentWeights.{name} must be finite and >= 0")

    def by_name(self) -> dict[str, float]:
        """Every component's weight, by its name (the fields: one per component)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def enabled(self) -> dict[str, float]:
        """The components that are on, with their weights."""
        return {k: v for k, v in self.by_name().items() if v}


def _norm(path: str) -> str:
    parts = [p for p in path.strip().split("/") if p not in ("", ".")]
    return "/".join(parts)


def task_outputs(task: Task) -> tuple[str, ...]:
    """The workspace paths the task declares as outputs (relative, normalised): the paths of its
    file checks and its `output:<path>` tags."""
    paths = []
    for check in task.checks:
        kind = check.WhichOneof("kind")
        if kind in FILE_CHECKS:
            paths.append(getattr(check, kind).path)
    paths += [t[len(OUTPUT_TAG) :] for t in task.tags if t.startswith(OUTPUT_TAG)]
    return tuple(sorted({n for n in map(_norm, paths) if n}))


def task_time_budget_s(task: Task, default_s: float) -> float:
    """The task's `time_budget_s:<s>` tag (a positive finite number), else `default_s`."""
    for tag in task.tags:
        if tag.startswith(TIME_BUDGET_TAG):
            try:
                value = float(tag[len(TIME_BUDGET_TAG) :])
            except ValueError:
                continue
            if math.isfinite(value) and value > 0:
                return value
    return default_s


def is_exempt(path: str, change: str, outputs: Sequence[str]) -> bool:
    """Whether a changed workspace `path` is the task's business (module doc, state_drift)."""
    path = _norm(path)
    for out in outputs:
        if path == out or path.startswith(out + "/"):
            return True
        if change == "added" and out.startswith(path + "/"):
            return True
    return False


def drifted_paths(diff: dict, outputs: Sequence[str]) -> int:
    """Changed paths of a sandbox diff body that are not exempt; the paths the sandbox did not
    list (`count` beyond `changed`) count as drifted."""
    listed = diff.get("changed") or []
    drifted = sum(1 for c in listed if not is_exempt(c["path"], c["change"], outputs))
    return drifted + max(0, int(diff.get("count", len(listed))) - len(listed))


def state_drift(diff: dict, outputs: Sequence[str], max_paths: int) -> float:
    """-min(1, drifted / max_paths), in [-1, 0]."""
    return -min(1.0, drifted_paths(diff, outputs) / max_paths) + 0.0


def time_efficiency(tool_events: Iterable[ToolEvent], budget_s: float) -> float:
    """-min(1, max(0, used_s / budget_s - 1)), in [-1, 0]; used_s from the commands' duration_ms."""
    used_s = sum(max(0.0, e.duration_ms) for e in command_events(tool_events)) / 1000.0
    return -min(1.0, max(0.0, used_s / budget_s - 1.0)) + 0.0


@dataclass(frozen=True)
class TerminalRewards:
    """What the verifier needs to compute the terminal components of one episode.

    escalation: needed when weights.safety > 0. drift_max_paths: drifted paths at which
    state_drift reaches -1. time_budget_s: budget of a task without a `time_budget_s:` tag."""

    weights: ComponentWeights
    escalation: SafetyEscalation | None = None
    drift_max_paths: int = 10
    time_budget_s: float = 60.0

    def __post_init__(self) -> None:
        if self.weights.safety and self.escalation is None:
            raise ValueError("the safety component needs a SafetyEscalation (Redis)")
        if self.drift_max_paths < 1 or not self.time_budget_s > 0:
            raise ValueError("drift_max_paths must be >= 1 and time_budget_s > 0")

    @property
    def needs_diff(self) -> bool:
        return bool(self.weights.state_drift)

    async def components(
        self,
        task: Task,
        tool_events: Sequence[ToolEvent],
        safety_rules: Sequence[str],
        diff: dict | None,
        trajectory_id: str = "",
    ) -> dict[str, float]:
        """The enabled components' values (unweighted). `diff`: the sandbox diff body (None: no
        session, drift 0). Raises redis.RedisError (safety)."""
        out: dict[str, float] = {}
        if self.weights.safety:
            commands = len(command_events(tool_events))
            rules = sorted(set(safety_rules))
            result = await self.escalation.apply(commands, rules, trajectory_id, task.task_id)
            out["safety"] = result.penalty + 0.0
            if not result.replayed:
                level = "escalated" if result.escalated else "base"
                if rules:
                    metrics.SAFETY_VIOLATIONS.labels(level).inc()
                metrics.SAFETY_STREAK_STEPS.set(0 if rules else result.streak_before + commands)
        if self.weights.state_drift:
            out["state_drift"] = (
                0.0 if diff is None else state_drift(diff, task_outputs(task), self.drift_max_paths)
            )
        if self.weights.time_efficiency:
            budget = task_time_budget_s(task, self.time_budget_s)
            out["time_efficiency"] = time_efficiency(tool_events, budget)
        return out
