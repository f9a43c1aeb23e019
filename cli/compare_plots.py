"""compare.png of `shellrl report --compare` (cli/compare.py draws from its aggregate):

* left: each eval set's success before and after training, the mean over runs as a bar with its
  95% interval (Student-t over runs; one run: its own interval), every run's value as a dot;
* right: per template of eval_id and eval_ood, the change in solved instances (after - before)
  of every run as a dot, their mean as a bar, and the tolerance of the target (-1 instance) as a
  dashed line: a dot below it is a regression beyond tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_compare(agg: dict, out: Path) -> str:
    """Write compare.png into `out`; returns its file name."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=(1, 1.6))
    _sets(left, agg["sets"], len(agg["runs"]))
    _templates(right, agg["templates"])
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)
    return "compare.png"


def _sets(ax, sets: dict, runs: int) -> None:
    names, width = list(sets), 0.38
    for offset, when, color in (
        (-width / 2, "before", "tab:gray"),
        (width / 2, "after", "tab:blue"),
    ):
        xs = [i + offset for i in range(len(names))]
        rows = [sets[n][when] for n in names]
        means = [_finite(r["mean"]) for r in rows]
        errors = [
            [
                max(0.0, m - r["low"]) if math.isfinite(r["low"]) else 0.0
                for m, r in zip(means, rows)
            ],
            [
                max(0.0, r["high"] - m) if math.isfinite(r["high"]) else 0.0
                for m, r in zip(means, rows)
            ],
        ]
        ax.bar(xs, means, width, yerr=errors, capsize=3, color=color, alpha=0.7, label=when)
        for x, r in zip(xs, rows):
            values = [v for v in r["values"] if math.isfinite(v)]
            ax.plot([x] * len(values), values, "k.", ms=5)
    ax.set_xticks(list(range(len(names))), names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success (mean pass rate over tasks)")
    ax.set_title(f"eval sets over {runs} run(s): mean, 95% interval, runs as dots", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _templates(ax, templates: dict) -> None:
    labels, deltas = [], []
    for name, by_template in templates.items():
        for key, e in sorted(by_template.items()):
            labels.append(f"{'ood' if name == 'eval_ood' else 'id'}: {key}")
            deltas.append([a - b for a, b in zip(e["after"], e["before"])])
    xs = list(range(len(labels)))
    ax.bar(xs, [sum(d) / len(d) if d else 0.0 for d in deltas], color="tab:blue", alpha=0.5)
    for x, d in zip(xs, deltas):
        ax.plot([x] * len(d), d, "k.", ms=5)
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(-1, color="tab:red", ls="--", lw=1, label="tolerance: -1 instance")
    ax.set_xticks(xs, labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("solved instances, after - before")
    ax.set_title("per template: mean change (bar), runs (dots)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0
