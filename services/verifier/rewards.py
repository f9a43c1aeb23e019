"""Reward function: the task outcome, plus shaping components that stay separate.

`reward` is the task outcome: 1.0 iff every check passed, else 0.0 (DESIGN.md section 8,
issue 6). Shaping terms are reported as named `reward_components` and enter `training_reward`
only when `Shaping.enabled` (off by default: a +0.1-per-exit-0 bonus was gamed within 15 steps in a
scratch run, the model learned to `echo` the question):

  exit_zero_bonus   +0.1 per command that exited 0, capped at +0.3
  timeout_penalty   -0.1 per command that timed out
  safety_penalty    -1.0 once, when the sandbox policy flagged (or denied) a destructive command

One rule is switched on by itself (`Shaping.require_command`, independent of `enabled`):

  ungrounded_success  -outcome when no command of the episode ran in the sandbox (none sent, or
                      every one denied by the policy): such a success trains as 0 (`reward` stays 1)

Why: with binary rewards GRPO amplifies lucky guesses. In main-job run6
(`git show 5456081:docs/main-job/run6/report.md`) a few early groups had a correct bare
`<answer>3</answer>` while their members that ran a command failed;
the group-relative advantages pushed the answer-at-once behaviour up and command use down, and from
step 3 every trained trajectory was a 7-token guess (mean reward of a step's 32 episodes 0.00-0.31,
eval_id 18.8% -> 3.1%). With the rule, a group whose only successes are guesses has no reward
variance and is not trained on. It checks that a command ran, not that the answer came from its
output: a policy could still learn "run anything, then guess" (watch `ungrounded_success` and the
commands per episode if a run's eval falls while its training reward rises).

The reward components of a real terminal (`safety`, `state_drift`, `time_efficiency`: penalties
only, each with its own weight, off by default) are computed in reward_components.py and enter
here as `terminal` values with their `terminal_weights`: reported under their names, added to
training_reward times their weights.

An unscored verification (INFRA failure) has no reward at all (NaN on the wire, null in JSON):
it never becomes a 0, and it is computed per trajectory, so it cannot touch another member of
its group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.verifier.plugin_rewards import plugin_components
from shellrl.contract import ToolEvent

SAFETY_VERDICTS = ("flag", "deny")


@dataclass(frozen=True)
class Shaping:
    """Weights of the shaping components. enabled=False: computed and reported, never trained on.
    require_command: `ungrounded_success` enters training_reward (whatever `enabled` says)."""

    enabled: bool = False
    exit_zero_bonus: float = 0.1
    exit_zero_cap: float = 0.3
    timeout_penalty: float = -0.1
    safety_penalty: float = -1.0
    require_command: bool = False

    def __post_init__(self) -> None:
        for name in ("exit_zero_bonus", "exit_zero_cap", "timeout_penalty", "safety_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"Shaping.{name} must be finite")


@dataclass(frozen=True)
class Reward:
    """reward: task outcome in {0, 1}. training_reward: what the learner optimizes (= reward unless
    shaping or require_command is on). components: outcome and every shaping term, always reported."""

    reward: float
    training_reward: float
    components: dict[str, float]


def command_events(tool_events: Iterable[ToolEvent]) -> list[ToolEvent]:
    """Tool events of commands that were sent to the sandbox (malformed actions are not commands)."""
    return [e for e in tool_events if not e.parse_error]


def compute_reward(
    checks_passed: Iterable[bool],
    tool_events: Iterable[ToolEvent],
    safety_flagged: bool,
    shaping: Shaping,
    terminal: Mapping[str, float] | None = None,
    terminal_weights: Mapping[str, float] | None = None,
) -> Reward:
    """Outcome and shaping of one verified episode.

    checks_passed: one bool per check (an empty list is an error: a task has at least one check).
    tool_events: the episode's OBSERVATION tool events. safety_flagged: the sandbox reported a
    safety event for the session or a tool event has verdict flag/deny. terminal: values of the
    enabled terminal components (reward_components.py), added times `terminal_weights[name]`.
    """
    passed = list(checks_passed)
    if not passed:
        raise ValueError("compute_reward: a task has at least one check")
    outcome = 1.0 if all(passed) else 0.0
    commands = command_events(tool_events)
    exit_zero = sum(1 for e in commands if e.exit_code == 0 and not e.timed_out)
    timed_out = sum(1 for e in commands if e.timed_out)
    components = {
        "outcome": outcome,
        "exit_zero_bonus": min(shaping.exit_zero_bonus * exit_zero, shaping.exit_zero_cap),
        "timeout_penalty": shaping.timeout_penalty * timed_out + 0.0,  # never -0.0
        "safety_penalty": shaping.safety_penalty if safety_flagged else 0.0,
        "ungrounded_success": -outcome
        if outcome and not any(e.policy_verdict != "deny" for e in commands)
        else 0.0,
    }
    training = outcome
    if shaping.enabled:
        training += (
            components["exit_zero_bonus"]
            + components["timeout_penalty"]
            + components["safety_penalty"]
        )
    if shaping.require_command:
        training += components["ungrounded_success"]
    for name, value in (terminal or {}).items():
        components[name] = value
        training += (terminal_weights or {}).get(name, 0.0) * value
    plugins = plugin_components(outcome, passed, commands, tuple(components))  # plugin_rewards.py
    for name, (value, weight) in plugins.items():
        components[name] = value
        training += weight * value
    if not math.isfinite(training):  # cannot happen with finite weights; never let it travel
        raise ValueError(f"non-finite training reward {training}")
    return Reward(outcome, training, components)


def safety_flagged(tool_events: Iterable[ToolEvent], sandbox_events: Iterable[object] = ()) -> bool:
    """True when the sandbox flagged or denied a command of the episode (its session's safety
    events, or the policy verdicts recorded on the tool events)."""
    return any(True for _ in sandbox_events) or any(
        e.policy_verdict in SAFETY_VERDICTS for e in tool_events
    )
