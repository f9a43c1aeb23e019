"""Failure classes of an episode (trajectory.proto `Failure`) and the one rule about them.

An INFRA failure (`FAILURE_INFRA_*`: the engine, the sandbox, the verifier or the gateway itself
failed, not the policy) says nothing about the policy: it is removed from its group, never scored
0, and a group with fewer than `min_group_size` members left is dropped (DESIGN.md section 4).
The rollout gateway's admission accounting and re-runs and the learner's group assembly all use
`is_infra`, so a group is counted the same way on every side. A member the verifier fails
(FAILURE_INFRA_VERIFIER) after the gateway handed its group off is not re-run; the gateway counts
the loss when it reads the scored stream (docs/design-notes.md, "INFRA failures after the rollout").
"""

from __future__ import annotations

from shellrl.v1.trajectory_pb2 import Failure

INFRA_FAILURES: frozenset[int] = frozenset(
    v for name, v in Failure.items() if name.startswith("FAILURE_INFRA_")
)
"""Every `FAILURE_INFRA_*` value (engine, sandbox, verifier, rollout)."""


RERUN_FAILURES: frozenset[int] = INFRA_FAILURES - {Failure.FAILURE_INFRA_VERIFIER}
"""INFRA failures of the rollout itself, which the gateway re-runs (attempt + 1) before it hands
the group off; the verifier's come after the hand-off and are never re-run."""


def failure_label(failure: int) -> str:
    """The one spelling of a failure class outside the proto (the HTTP APIs, metric labels, task
    statistics, transcripts, logs): Failure.FAILURE_INFRA_ENGINE -> "infra_engine",
    FAILURE_NONE -> "none". ValueError for a value the enum does not have."""
    return Failure.Name(failure).removeprefix("FAILURE_").lower()


def is_infra(failure: int | None) -> bool:
    """True when `failure` (a `Failure` enum value; None = no failure) is an INFRA class."""
    return failure in INFRA_FAILURES


def is_rerun(failure: int | None) -> bool:
    """True when a re-run of the sample follows this failure (`RERUN_FAILURES`): the learner waits
    for it; after any other INFRA failure (the verifier's) the sample has arrived for good."""
    return failure in RERUN_FAILURES
