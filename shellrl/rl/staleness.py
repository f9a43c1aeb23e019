"""Staleness of trajectories and the admission bound that keeps it small (DESIGN.md section 5).

staleness = learner_version - min(policy_version of the trajectory's ACTION segments), measured at
training time (not at arrival: a trajectory that waits in a queue ages; known_pitfalls.md C18).
A trajectory is trained only if staleness <= max_staleness; max_staleness = 0 is on-policy
(every trained token was sampled by the weights being trained). Source of the admission bound:
AReaL's StalenessManager (inclusionAI/AReaL areal/infra/staleness_manager.py; arXiv 2505.24298).
"""

from __future__ import annotations

import numpy as np


def staleness(learner_version: int, min_policy_version: int) -> int:
    """Versions between the weights being trained and the oldest weights that sampled a token.

    Negative when a trajectory was sampled by weights the learner has since rolled back (a crash
    after a push but before the checkpoint); callers treat that as fresh (0) and log it.
    """
    return int(learner_version) - int(min_policy_version)


def is_too_stale(learner_version: int, min_policy_version: int, max_staleness: int) -> bool:
    """True when the trajectory must be dropped: staleness > max_staleness (bound inclusive)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0; got {max_staleness}")
    return staleness(learner_version, min_policy_version) > max_staleness


def oldest_trainable_version(learner_version: int, max_staleness: int) -> int:
    """The oldest policy version a token may be sampled with and still be trained at
    `learner_version`: is_too_stale(learner_version, v, max_staleness) exactly when v is below it
    (the gateway routes episodes only to engines serving at least this, engine_directory.py)."""
    return int(learner_version) - int(max_staleness)


def max_admitted_groups(learner_version: int, max_staleness: int, groups_per_step: int) -> int:
    """Groups the gateway may have admitted in total: (learner_version + max_staleness + 1) * groups_per_step.

    A new group is admitted while groups_admitted < this bound.
    """
    return (int(learner_version) + int(max_staleness) + 1) * int(groups_per_step)


def admission_bound_terms(max_staleness: int, groups_per_step: int) -> tuple[int, int]:
    """`max_admitted_groups` as (bound at version 0, groups each version adds), for code that
    learns the version later (the gateway's admission script reads it inside Redis):
    bound(version) = at_zero + version * per_version, the same numbers as `max_admitted_groups`
    (tests/unit/test_staleness_rule.py checks the script against it on a grid)."""
    at_zero = max_admitted_groups(0, max_staleness, groups_per_step)
    return at_zero, max_admitted_groups(1, max_staleness, groups_per_step) - at_zero


def fresh_token_mask(policy_versions: np.ndarray, learner_version: int) -> np.ndarray:
    """policy_versions: [...] int (-1 on non-ACTION tokens) -> bool mask of tokens sampled by
    `learner_version` itself (the tokens on which learner and engine log-probs must agree)."""
    return np.asarray(policy_versions) == int(learner_version)
