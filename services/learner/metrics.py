"""Prometheus metrics of the learner (DESIGN.md section 9 names plus the learner's own)."""

from __future__ import annotations

from collections.abc import Iterable

from shellrl.service import metrics as m
from shellrl.service.metrics import STALENESS_BUCKETS, register_gpu_memory

register_gpu_memory()  # shellrl_gpu_memory_bytes: the policy, optimizer and activations on a GPU

POLICY_VERSION = m.gauge(
    "shellrl_policy_version", "Policy version of the learner's weights (learner steps taken)."
)
LEARNER_STEP = m.gauge("shellrl_learner_step", "Learner steps taken.")
STALENESS = m.histogram(
    "shellrl_trajectory_staleness",
    "learner_version - min segment policy_version at training time, versions.",
    buckets=STALENESS_BUCKETS,
)
AGE = m.histogram(
    "shellrl_trajectory_age_seconds",
    "Seconds from episode end (finished_at) to training.",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600),
)
TRAINED = m.counter(
    "shellrl_learner_trajectories_trained_total", "Trajectories that entered a training batch."
)
DROPPED = m.counter(
    "shellrl_trajectories_dropped_total",
    "Trajectories the learner did not train on, by reason.",
    ("reason",),
)


def init_series(drop_reasons: Iterable[str]) -> None:
    """Create the labelled series known at start-up (value 0): dashboards then show 0, not "no data",
    before the first drop. drop_reasons: group_assembler.DROP_REASONS."""
    for reason in drop_reasons:
        DROPPED.labels(reason)


GROUPS = m.counter(
    "shellrl_learner_groups_total",
    "Released groups by outcome: trained, zero_variance "
    "(no gradient), dropped (counted, nothing trainable), not_counted (< 2 usable samples).",
    ("outcome",),
)
STEP_SECONDS = m.histogram(
    "shellrl_learner_step_seconds", "Wall time of one learner step's training, seconds."
)
PHASE_SECONDS = m.histogram(
    "shellrl_learner_phase_seconds", "Wall time of the worker's phases, seconds.", ("phase",)
)
WEIGHT_SYNC_SECONDS = m.histogram(
    "shellrl_weight_sync_seconds",
    "Weight sync phases: pause (pause_generation answered: the engine's current iteration "
    "ended), flatten (plan; unstreamed transports also copy), fill (streamed: slots filled, host "
    "time), transfer (engines copy the bucket), load (engines swap weights in), verify, continue "
    "(continue_generation answered), total.",
    ("phase",),
)
WEIGHT_SYNC_RESIDENT_BYTES = m.gauge(
    "shellrl_weight_sync_resident_bytes",
    "Most bytes the learner's push buckets held at once during the last streamed push (on the "
    "engines' GPU for cuda_ipc, in shared memory for shm): at most two buckets.",
)
WEIGHT_SYNC_FAILURES = m.counter(
    "shellrl_weight_sync_failures_total",
    "Engine updates that failed or missed the deadline, by reason.",
    ("reason",),
)
ENGINES_IN_SYNC = m.gauge(
    "shellrl_learner_engines_in_sync", "Engines that confirmed the current version."
)
ENGINES_OUT = m.gauge(
    "shellrl_learner_engines_out_of_rotation", "Engines taken out of rotation (no confirmation)."
)
REWARD = m.gauge(
    "shellrl_learner_reward", "Mean training_reward of the last step's trained trajectories."
)
SUCCESS_RATE = m.gauge(
    "shellrl_learner_success_rate", "Fraction of the last step's trajectories with reward >= 1."
)
LOSS = m.gauge("shellrl_learner_loss", "Loss terms of the last step.", ("term",))
CLIP_FRACTION = m.gauge(
    "shellrl_learner_clip_fraction", "Fraction of tokens clipped in the last step.", ("kind",)
)
IMPORTANCE_WEIGHT = m.gauge(
    "shellrl_learner_importance_weight",
    "Behavior importance weight of the last step (mean, max, truncated_fraction).",
    ("stat",),
)
LOGPROB_DIFF = m.gauge(
    "shellrl_logprob_diff",
    "|logp_prox - logp_behavior| over version-fresh tokens, nats (mean, max) of the last step.",
    ("stat",),
)
GRAD_NORM = m.gauge("shellrl_learner_grad_norm", "Global gradient norm before clipping, last step.")
LR = m.gauge("shellrl_learner_lr", "Learning rate of the last step.")
TOKENS = m.counter("shellrl_learner_tokens_total", "Scored (loss-mask) tokens trained on.")
TOKENS_PER_SECOND = m.gauge(
    "shellrl_learner_tokens_per_second", "Scored tokens per second of the last step."
)
RSS_BYTES = m.gauge("shellrl_learner_rss_bytes", "Resident set size after the last step, bytes.")
PEAK_MEMORY_BYTES = m.gauge(
    "shellrl_learner_peak_memory_bytes", "Peak RSS of the process (ru_maxrss), bytes."
)
CHECKPOINT_SECONDS = m.histogram(
    "shellrl_learner_checkpoint_seconds", "Time to write one checkpoint, seconds."
)
SKIPPED_UPDATES = m.counter(
    "shellrl_learner_skipped_updates_total", "Optimizer updates skipped (non-finite grad)."
)
ZERO_VARIANCE_FRACTION = m.gauge(
    "shellrl_learner_zero_variance_fraction",
    "Fraction of the last step's counted "
    "groups whose rewards were all equal (no gradient; known_pitfalls C10).",
)
