"""Reward components from plug-ins (entry point group `shellrl.rewards`; docs/plugins.md).

A reward plug-in is a callable with an optional `weight` attribute (default 0.0):

    component(*, outcome: float, checks_passed: list[bool], tool_events: list[ToolEvent],
              **later) -> float

It is reported under its entry point's name in `reward_components` and enters
`training_reward` as `weight * value` (weight 0: reported only, as the shaping terms are by
default, rewards.py). Accept `**kwargs`: later versions may pass more. A plug-in that raises, or
returns a non-finite value, fails the verification as FAILURE_INFRA_VERIFIER (verification.py
turns any error of one verification into that), never a silent 0; a name that a built-in
component already uses is refused the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shellrl.contract import ToolEvent
from shellrl.plugins import REWARDS, load_all


def plugin_components(
    outcome: float,
    checks_passed: Sequence[bool],
    tool_events: Sequence[ToolEvent],
    reserved: tuple[str, ...],
) -> dict[str, tuple[float, float]]:
    """{name: (value, weight)} of every installed reward plug-in, sorted by name. reserved: the
    component names already taken. Raises PluginError, ValueError (non-finite value or weight)."""
    out = {}
    for name, component in load_all(REWARDS, reserved=reserved).items():
        value = float(
            component(
                outcome=outcome, checks_passed=list(checks_passed), tool_events=list(tool_events)
            )
        )
        weight = float(getattr(component, "weight", 0.0))
        if not (math.isfinite(value) and math.isfinite(weight)):
            raise ValueError(
                f"reward plug-in {name!r}: non-finite value {value} or weight {weight}"
            )
        out[name] = (value, weight)
    return out
