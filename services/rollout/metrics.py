"""Prometheus metrics of the rollout gateway (names per DESIGN.md section 9; no ids as labels)."""

from __future__ import annotations

from shellrl.service import metrics

EPISODES_IN_FLIGHT = metrics.gauge("shellrl_episodes_in_flight", "Training episodes running now.")
EVAL_EPISODES_IN_FLIGHT = metrics.gauge(
    "shellrl_rollout_eval_episodes_in_flight", "Evaluation episodes running now."
)
TOKENS = metrics.counter(
    "shellrl_rollout_tokens_total",
    "Tokens by kind: prompt, action (engine-sampled), observation (harness).",
    ("kind",),
)
# the agent loop counts tokens every turn: its series bound once (a `labels()` lookup per turn is
# a lock and a dict; each series exists from the start)
PROMPT_TOKENS, ACTION_TOKENS, OBSERVATION_TOKENS = (
    TOKENS.labels(kind) for kind in ("prompt", "action", "observation")
)
TURNS = metrics.counter("shellrl_rollout_turns_total", "Agent turns (one model reply each).")
EPISODES = metrics.counter(
    "shellrl_rollout_episodes_total",
    "Finished episodes by how they ended (answer, max_turns, context, failure).",
    ("end",),
)
FAILURES = metrics.counter(
    "shellrl_rollout_failures_total", "Episodes that ended with a failure class.", ("failure",)
)
RETRIES = metrics.counter(
    "shellrl_rollout_retries_total", "Samples re-run with attempt+1 after an INFRA failure."
)
PARSE_ERRORS = metrics.counter(
    "shellrl_rollout_parse_errors_total",
    "Malformed replies by kind (the observation says what was wrong).",
    ("kind",),
)
PARTIAL_CONTINUATIONS = metrics.counter(
    "shellrl_rollout_partial_continuations_total",
    "Generate requests aborted (weight update) and continued in the same turn (partial rollout).",
)
VERSION_EPISODES = metrics.counter(
    "shellrl_rollout_episodes_by_version_total",
    "Finished episodes by the oldest policy version of their ACTION tokens.",
    ("policy_version",),
)
GENERATE_SECONDS = metrics.histogram(
    "shellrl_rollout_generate_seconds", "Latency of one /generate call."
)
EXEC_SECONDS = metrics.histogram(
    "shellrl_rollout_exec_seconds", "Latency of one sandbox exec call (HTTP round trip)."
)
SESSION_SECONDS = metrics.histogram(
    "shellrl_rollout_session_create_seconds", "Sandbox session creation (setup)."
)
EPISODE_SECONDS = metrics.histogram("shellrl_rollout_episode_seconds", "Wall time of one episode.")
ADMISSION_WAIT_SECONDS = metrics.histogram(
    "shellrl_rollout_admission_wait_seconds",
    "Time admission waited, by reason: staleness, capacity, backlog, engine_down, sandbox_down, sandbox_busy.",
    ("reason",),
)
SANDBOX_WAITING = metrics.gauge(
    "shellrl_rollout_sandbox_waiting_episodes",
    "Episodes waiting for a sandbox session now because every sandbox service answered 429 "
    "(shellrl/clients/sandbox_fleet.py); their waits are in admission_wait_seconds{sandbox_busy}.",
)
GROUPS_ADMITTED = metrics.counter("shellrl_rollout_groups_admitted_total", "GRPO groups admitted.")
GROUPS_RELEASED = metrics.counter(
    "shellrl_rollout_groups_released_total",
    "Admitted groups given back (fewer than 2 usable trajectories at hand-off or after the "
    "verifier's INFRA failures, or abandoned at shutdown).",
)
GROUPS_ZERO_VARIANCE = metrics.counter(
    "shellrl_rollout_groups_zero_variance_total",
    "Admitted groups given back by dynamic sampling: every usable member scored the same reward "
    "(counted in groups_released too).",
)
TASKS_PASSED_OVER = metrics.counter(
    "shellrl_rollout_tasks_passed_over_total",
    "Tasks of the epoch order not run this epoch because pass-rate steering passed over them "
    "(their template's recent success rate stayed at 0 or 1).",
)
POOL_TASKS = metrics.gauge("shellrl_rollout_pool_tasks", "Tasks in the training pool.")
POLICY_VERSION = metrics.gauge(
    "shellrl_rollout_learner_version", "shellrl:policy:version as the gateway last read it."
)
EPOCH = metrics.gauge("shellrl_rollout_epoch", "Current epoch over the training pool.")
TASKS_SUBMITTED = metrics.counter(
    "shellrl_rollout_tasks_submitted_total", "Tasks accepted by POST /v1/tasks.", ("status",)
)
STATS_RECORDED = metrics.counter(
    "shellrl_rollout_scored_trajectories_total", "Scored trajectories counted into task statistics."
)
EVALUATIONS = metrics.counter(
    "shellrl_rollout_evaluations_total", "Evaluations by final state.", ("state",)
)
ENGINES_ROUTABLE = metrics.gauge(
    "shellrl_rollout_engines_routable",
    "Engines the gateway routes to now (members in the learner's rotation, within the staleness "
    "bound; engine_directory.py).",
)
ENGINE_FAILOVERS = metrics.counter(
    "shellrl_rollout_engine_failovers_total",
    "Requests of an episode moved to another engine, by reason: unreachable (failed, left or "
    "no answer), not_routable (its engine takes no traffic now), stale (answer below the "
    "staleness floor, discarded).",
    ("reason",),
)
SANDBOX_HEALTH_SCORE = metrics.gauge(
    "shellrl_rollout_sandbox_health_score",
    "Terminal health score of the sandbox (mean over a fleet) as admission last read it.",
)
GROUPS_DELAYED_UNHEALTHY = metrics.counter(
    "shellrl_rollout_groups_delayed_unhealthy_total",
    "New groups delayed because the sandbox health score was below the threshold.",
)
