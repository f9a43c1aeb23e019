"""Estimators of the main job's evaluations: success of an eval set and of each template, with a
95% interval, from the evaluation views of GET /v1/evaluations/{id}.

One evaluation runs k episodes per task: k = 1 greedy (the default), k > 1 sampled at a fixed
temperature (`shellrl run --eval-samples K --eval-temperature T`). Episodes without a score
(INFRA failures) are left out, as in the view's own success_rate.
* Per task: pass rate = successes / scored episodes.
* Per set: the mean pass rate over tasks with a scored episode (k = 1: the success rate).
  Interval: k = 1, the Wilson score interval over tasks (Wilson 1927); k > 1, a percentile
  bootstrap over tasks (a task's k episodes are correlated, so they are resampled together;
  `BOOTSTRAP_RESAMPLES` resamples, fixed seed, so a report is reproducible); when every task has
  the same pass rate (all 0 or all 1, typically) the bootstrap has no spread, and the Wilson
  interval over tasks (the mean pass rate as the proportion) stands in.
* Per template: `solved` = the sum of its tasks' pass rates, in instances (k = 1: the number of
  instances solved), out of `instances` tasks; the job's regression rule counts in these units.
Over several runs (cli/compare.py): the mean of the runs' values with a Student-t 95% interval
(n - 1 degrees of freedom), the spread of training outcomes across seeds.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from shellrl import contract

NAN = float("nan")
Z_95 = 1.959963984540054
BOOTSTRAP_RESAMPLES = 2000
# two-sided 95% Student-t quantiles (t_0.975) for 1..30 degrees of freedom
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
          2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
          2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


@dataclass(frozen=True)
class Score:
    """An eval set's success: `rate` in [0, 1] with its 95% interval (NaN when nothing scored)."""

    rate: float
    low: float
    high: float
    tasks: int
    episodes: int
    samples_per_task: int
    estimator: str


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (Wilson 1927); (nan, nan) when n = 0.
    `successes` may be fractional (a sum of pass rates)."""
    if n <= 0:
        return NAN, NAN
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def t_quantile_975(df: int) -> float:
    """t_0.975 with `df` degrees of freedom (table to 30, then a Cornish-Fisher expansion)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1; got {df}")
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = Z_95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df * df)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t 95% interval of the mean of `values` (NaN bounds for
    fewer than 2 values; NaN mean for none)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return NAN, NAN, NAN
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, NAN, NAN
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    half = t_quantile_975(len(xs) - 1) * sd / math.sqrt(len(xs))
    return mean, mean - half, mean + half


def task_outcomes(view: dict | None) -> dict[str, tuple[int, int]]:
    """{task_id: (successes, scored episodes)} of an evaluation view's per-episode results."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in (view or {}).get("results", []):
        if r.get("reward") is None and r.get("outcome") not in ("success", "wrong"):
            continue
        out[r["task_id"]][1] += 1
        out[r["task_id"]][0] += int(r.get("outcome") == "success")
    return {t: (s, n) for t, (s, n) in out.items()}


def set_score(view: dict | None) -> Score:
    """The set's success and its 95% interval (module docstring). A view without per-episode
    results (a summary) falls back to its success_rate over episodes_scored, Wilson interval."""
    outcomes = {t: sn for t, sn in task_outcomes(view).items() if sn[1] > 0}
    if not outcomes:
        n = int((view or {}).get("episodes_scored") or 0)
        rate = (view or {}).get("success_rate")
        if not n or rate is None:
            return Score(NAN, NAN, NAN, 0, n, 1, "none")
        lo, hi = wilson_interval(round(rate * n), n)
        return Score(float(rate), lo, hi, n, n, 1, "wilson over episodes")
    rates = [s / n for s, n in outcomes.values()]
    episodes = sum(n for _, n in outcomes.values())
    k = max(n for _, n in outcomes.values())
    mean = sum(rates) / len(rates)
    if k <= 1:
        lo, hi = wilson_interval(sum(s for s, _ in outcomes.values()), len(rates))
        return Score(mean, lo, hi, len(rates), episodes, 1, "wilson over tasks")
    if max(rates) == min(rates):
        lo, hi = wilson_interval(mean * len(rates), len(rates))
        return Score(mean, lo, hi, len(rates), episodes, k, "wilson over tasks (no spread)")
    lo, hi = bootstrap_interval(rates)
    return Score(mean, lo, hi, len(rates), episodes, k, "bootstrap over tasks")


def bootstrap_interval(
    values: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of `values` (resampled with replacement)."""
    xs = np.asarray(values, dtype=np.float64)
    if xs.size == 0:
        return NAN, NAN
    rng = np.random.default_rng(seed)
    means = xs[rng.integers(0, xs.size, size=(resamples, xs.size))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def template_of(task_id: str, tasks_by_id: dict | None = None) -> str:
    """A task's template: the task's own field (or source) when known, else parsed from a
    generated task id (`[eval-]gen-<template>-<12 hex>`), else the task id itself."""
    task = (tasks_by_id or {}).get(task_id)
    if task is None:
        return contract.template_of(task_id)
    return contract.template_of(task_id, task.template, task.source)


def template_scores(view: dict | None, tasks_by_id: dict | None = None) -> dict[str, dict]:
    """{template: {"instances": tasks, "solved": sum of pass rates}} over the tasks of the view
    with a scored episode (k = 1: solved counts the instances solved)."""
    out: dict[str, dict] = {}
    for task_id, (successes, n) in sorted(task_outcomes(view).items()):
        if n == 0:
            continue
        entry = out.setdefault(template_of(task_id, tasks_by_id), {"instances": 0, "solved": 0.0})
        entry["instances"] += 1
        entry["solved"] += successes / n
    return out
