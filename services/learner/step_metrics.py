"""The record of one learner step (`step_record`: the dict /v1/status serves as `last_step`, the
tracker logs and steps.jsonl keeps) and its Prometheus metrics (`export_step_metrics`: loss, clip
fractions, importance weights, log-prob parity, gradient norm, tokens; rewards, zero-variance
fraction, this process's memory: `process_memory`), made by the worker after every step
(worker.py `LearnerWorker.record`).
"""

from __future__ import annotations

import os
import resource
import time

from services.learner import metrics
from services.learner.template_kl import kl_by_template


def export_step_metrics(result) -> None:
    """The gauges and counters of one optimizer step (`step_records.StepResult`)."""
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


def step_record(
    step, version, groups, samples, rewards, outcomes, result, seconds, staleness
) -> dict:
    """The record of step `step` (trained on the weights of `version`), its gauges set.

    groups: the step's RolloutGroups; samples: the TrainSamples trained; rewards: (training
    reward, reward) per member of a trainable group; outcomes: one per group ("trained",
    "zero_variance", "dropped", "not_counted"); result: the merged StepResult, None for a step
    without samples; seconds: the step's wall time; staleness: per trained trajectory, in
    versions. Keys: step, trained_on_version, groups, zero_variance_fraction, outcomes,
    trajectories, reward_mean, success_rate, seconds, finished_at (epoch s), with a result its
    lr, tokens, loss, kl, grad_norm, stats, parity_*, tokens_per_second, kl_by_template; then
    rss_bytes and, when any trajectory trained, staleness_mean and staleness_max."""
    metrics.TRAINED.inc(len(samples))
    metrics.POLICY_VERSION.set(step)
    metrics.LEARNER_STEP.set(step)
    metrics.STEP_SECONDS.observe(seconds)
    reward_mean = sum(r for r, _ in rewards) / len(rewards) if rewards else 0.0
    success = sum(o >= 1.0 for _, o in rewards) / len(rewards) if rewards else 0.0
    metrics.REWARD.set(reward_mean)
    metrics.SUCCESS_RATE.set(success)
    counted = [o for o in outcomes if o != "not_counted"]
    zero_fraction = counted.count("zero_variance") / len(counted) if counted else 0.0
    metrics.ZERO_VARIANCE_FRACTION.set(zero_fraction)
    record = {
        "step": step,
        "trained_on_version": version,
        "groups": len(groups),
        "zero_variance_fraction": zero_fraction,
        "outcomes": {o: outcomes.count(o) for o in set(outcomes)},
        "trajectories": len(samples),
        "reward_mean": reward_mean,
        "success_rate": success,
        "seconds": seconds,
        "finished_at": time.time(),
    }
    if result is not None:
        s = result.stats
        record.update(
            {
                "lr": result.lr,
                "tokens": result.tokens,
                "loss": s["policy_loss"],
                "kl": s["kl"],
                "grad_norm": result.grad_norm,
                "stats": s,
                "parity_mean": result.parity_mean,
                "parity_max": result.parity_max,
                "parity_tokens": result.parity_tokens,
                "tokens_per_second": result.tokens / max(result.duration_s, 1e-9),
                "kl_by_template": kl_by_template(groups, result.row_kl),
            }
        )
        export_step_metrics(result)
    rss, peak = process_memory()
    metrics.RSS_BYTES.set(rss)
    metrics.PEAK_MEMORY_BYTES.set(peak)
    record["rss_bytes"] = rss
    if staleness:
        record.update(staleness_mean=sum(staleness) / len(staleness), staleness_max=max(staleness))
    return record
