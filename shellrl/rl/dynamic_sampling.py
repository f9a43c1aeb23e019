"""Dynamic sampling: a learner step waits for groups whose rewards vary (DAPO, Yu et al. 2025,
arXiv 2503.14476, section 3.2 "Dynamic Sampling": over-sample and filter out prompts whose
accuracy is 0 or 1, until the batch holds B groups with a gradient).

A group whose usable members (no INFRA failure) all have the same reward key carries no signal
(every GRPO advantage is 0, shellrl.rl.advantages). With dynamic sampling on, such a group does
not use one of the `groups_per_step` slots of a step: the rollout gateway gives its admission
back (services/rollout/admission.py) and admits another group in its place, under the same
staleness bound, and the learner's group assembler does not count it
(services/learner/group_assembler.py). Both sides decide with `reward_key`, on the same
trajectories, so the gateway's admitted count and the learner's versions stay in step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

UNSCORED = "unscored"


def reward_key(training_reward: float, scored: bool) -> str:
    """The value a group's variance is judged on: the training reward as `repr` of a float
    (-0.0 folded into 0.0, so equal floats give equal keys), or "unscored" for a trajectory
    the verifier passed on without a score or with a non-finite reward."""
    if not scored or not math.isfinite(training_reward):
        return UNSCORED
    return repr(float(training_reward) + 0.0)


def has_variance(keys: Iterable[str]) -> bool:
    """True when the keys of a group's usable members are not all equal (2+ distinct values)."""
    return len(set(keys)) > 1
