"""Prometheus metrics of the verifier (names checked by shellrl.service.metrics).

Verifications per second: rate(shellrl_verifier_verifications_total[1m]); pass rate per task
source and split: the ratio of its outcome="pass" series to the sum over outcomes. One
verification is recorded by verification.py (`record_verification`), which knows its result.
"""

from __future__ import annotations

from shellrl.service import metrics

REWARD_BUCKETS = (-1.5, -1.0, -0.5, -0.1, 0.0, 0.1, 0.3, 0.5, 0.9, 1.0, 1.1, 1.3)

VERIFICATIONS = metrics.counter(
    "shellrl_verifier_verifications_total",
    "Verifications finished, by task source, split and outcome (pass/fail/infra).",
    ("source", "split", "outcome"),
)
VERIFICATION_SECONDS = metrics.histogram(
    "shellrl_verifier_verification_seconds",
    "Wall time of one verification (all checks and the reward).",
)
CHECK_SECONDS = metrics.histogram(
    "shellrl_verifier_check_seconds",
    "Wall time of one check, by type and result (pass/fail).",
    ("type", "result"),
)
REWARD = metrics.histogram(
    "shellrl_verifier_reward",
    "Task outcome of scored verifications (0 or 1).",
    buckets=REWARD_BUCKETS,
)
TRAINING_REWARD = metrics.histogram(
    "shellrl_verifier_training_reward",
    "Outcome plus enabled shaping terms and, with require_command, ungrounded_success.",
    buckets=REWARD_BUCKETS,
)
FAILURES = metrics.counter(
    "shellrl_verifier_failures_total",
    "Verifications that could not complete, by check type ('' = none).",
    ("type",),
)
TRAJECTORIES = metrics.counter(
    "shellrl_verifier_trajectories_total",
    "Trajectories handled by the stream worker: scored, passed_through (already failed upstream), "
    "unscored (verification failed), duplicate (already forwarded), undecodable (retried, then dead-lettered).",
    ("outcome",),
)
SESSION_RELEASES = metrics.counter(
    "shellrl_verifier_session_releases_total",
    "DELETE of episode sandbox sessions, by result (ok/gone/error).",
    ("result",),
)
REFERENCE_RUNS = metrics.counter(
    "shellrl_verifier_reference_runs_total",
    "reference_command lookups: hit (cache) or run (fresh session).",
    ("result",),
)
# a summary, not a histogram: components are negative, and a histogram with negative buckets
# exposes no _sum, so the dashboard's mean per component would have no data
REWARD_COMPONENT = metrics.summary(
    "shellrl_verifier_reward_component",
    "Value of each reward component of scored verifications (unweighted), by component name.",
    ("component",),
)
SAFETY_VIOLATIONS = metrics.counter(
    "shellrl_verifier_safety_violations_total",
    "Episodes the safety component penalised, by level (base: -5, escalated: -8 by default).",
    ("level",),
)
for _level in ("base", "escalated"):  # both series exist from the start: a rate of 0, not none
    SAFETY_VIOLATIONS.labels(_level)
SAFETY_STREAK_STEPS = metrics.gauge(
    "shellrl_verifier_safety_streak_steps",
    "Commands since the run's last safety violation, as this verifier last recorded it.",
)
IN_FLIGHT = metrics.gauge(
    "shellrl_verifier_in_flight", "Verifications running now (worker and HTTP)."
)


def record_check(kind: str, passed: bool, duration_s: float) -> None:
    CHECK_SECONDS.labels(kind, "pass" if passed else "fail").observe(duration_s)
