"""A reward component (entry point group `shellrl.rewards`): +0.1 for a success that took at
most two commands. `weight` 0.5: it enters training_reward as 0.5 * value (0 would only report
it under `reward_components["few_commands"]`)."""

from __future__ import annotations


def few_commands(*, outcome: float, checks_passed, tool_events, **_later) -> float:
    commands = [e for e in tool_events if not e.parse_error]
    return 0.1 if outcome and len(commands) <= 2 else 0.0


few_commands.weight = 0.5
