"""The learner's per-step metrics (`export_step_metrics`: loss, clip fractions, importance
weights, log-prob parity, gradient norm, tokens) and this process's memory (`process_memory`),
recorded by the worker after every step (worker.py `LearnerWorker.record`).
"""

from __future__ import annotations

import os
import resource

from services.learner import metrics


def export_step_metrics(result) -> None:
    """The gauges and counters of one optimizer step (`trainer.StepResult`)."""
    s = result.stats
    metrics.LOSS.labels("policy").set(s["policy_loss"])
    metrics.LOSS.labels("kl").set(s["kl"])
    metrics.CLIP_FRACTION.labels("low").set(s["clip_fraction_low"])
    metrics.CLIP_FRACTION.labels("high").set(s["clip_fraction_high"])
    metrics.CLIP_FRACTION.labels("dual").set(s["dual_clip_fraction"])
    metrics.IMPORTANCE_WEIGHT.labels("mean").set(s["is_weight_mean"])
    metrics.IMPORTANCE_WEIGHT.labels("max").set(s["is_weight_max"])
    metrics.IMPORTANCE_WEIGHT.labels("truncated_fraction").set(s["is_truncated_fraction"])
    metrics.LOGPROB_DIFF.labels("mean").set(result.parity_mean)
    metrics.LOGPROB_DIFF.labels("max").set(result.parity_max)
    metrics.GRAD_NORM.set(result.grad_norm)
    metrics.LR.set(result.lr)
    metrics.TOKENS.inc(result.tokens)
    metrics.TOKENS_PER_SECOND.set(result.tokens / max(result.duration_s, 1e-9))
    metrics.SKIPPED_UPDATES.inc(result.skipped_updates)


def process_memory() -> tuple[int, int]:
    """(current RSS, peak RSS) in bytes."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), resource.getrusage(
        resource.RUSAGE_SELF
    ).ru_maxrss * 1024
