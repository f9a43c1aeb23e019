"""The main job's report: PNG plots and `report.md` under `<state>/report/`.

Inputs: the evaluations before/after (GET /v1/evaluations/{id} views), the learner's step ledger
(`steps.jsonl`: reward_mean, success_rate, seconds, tokens_per_second, rss_bytes per step), the
status snapshots taken while training, and the final /metrics texts of learner and rollout.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from shellrl.contract import task_to_json  # noqa: E402
from cli.stack_status import histogram_buckets, quantile_from_buckets  # noqa: E402


def _rate(view: dict | None) -> float | None:
    return None if not view else view.get("success_rate")


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "n/a"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def per_template(view: dict, tasks_by_id: dict) -> dict[str, list[int]]:
    """{template or source: [successes, episodes]} from an evaluation's per-episode results."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in view.get("results", []):
        task = tasks_by_id.get(r.get("task_id"))
        key = (task.template or task.source or "?") if task is not None else "?"
        out[key][1] += 1
        out[key][0] += int(r.get("outcome") == "success")
    return dict(out)


def _plot_curves(steps: list[dict], out: Path) -> list[str]:
    files = []
    if not steps:
        return files
    xs = [s["step"] for s in steps]
    wall = []
    t = 0.0
    for s in steps:
        t += float(s.get("seconds") or 0)
        wall.append(t / 60)
    for x, label, name in ((xs, "learner step", "vs_step"), (wall, "training wall-clock (min, sum of step times)", "vs_time")):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(x, [s.get("reward_mean", 0) for s in steps], label="mean reward (training batch)")
        ax.plot(x, [s.get("success_rate", 0) for s in steps], label="success rate (training batch)", alpha=0.8)
        ax.set_xlabel(label)
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"reward_success_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path.name)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [s.get("tokens_per_second") or 0 for s in steps], label="learner tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [(s.get("rss_bytes") or 0) / 2**30 for s in steps], color="tab:red", label="learner RSS (GiB)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("tokens/s")
    ax2.set_ylabel("RSS GiB")
    ax.grid(alpha=0.3)
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)
    files.append("throughput.png")
    return files


def _plot_staleness(buckets: dict[float, float], out: Path) -> str | None:
    if not buckets:
        return None
    les = list(buckets)
    counts = [buckets[les[0]]] + [buckets[les[i]] - buckets[les[i - 1]] for i in range(1, len(les))]
    labels = [("+Inf" if le == float("inf") else f"≤{le:g}") for le in les]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(labels, counts)
    ax.set_xlabel("staleness at training time (policy versions)")
    ax.set_ylabel("trajectories")
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=110)
    plt.close(fig)
    return "staleness.png"


def _plot_eval(before: dict, after: dict, out: Path) -> str:
    names = list(before)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    xs = range(len(names))
    ax.bar([x - width / 2 for x in xs], [(_rate(before[n]) or 0) for n in names], width, label="before")
    ax.bar([x + width / 2 for x in xs], [(_rate(after.get(n)) or 0) for n in names], width, label="after")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("greedy success rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "eval_before_after.png", dpi=110)
    plt.close(fig)
    return "eval_before_after.png"


def write_report(out: Path, *, config: dict, before: dict, after: dict, steps: list[dict], snapshots: list[dict],
                 learner_metrics: str, rollout_metrics: str, train_s: float, total_s: float,
                 tasks_by_id: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    # keep only the last record of each step (a resume rewrites rolled-back steps)
    by_step = {}
    for s in steps:
        if "step" in s and "event" not in s:
            by_step[s["step"]] = s
    steps = [by_step[k] for k in sorted(by_step)]
    plots = _plot_curves(steps, out)
    stale = histogram_buckets(learner_metrics, "shellrl_trajectory_staleness")
    if (p := _plot_staleness(stale, out)) is not None:
        plots.append(p)
    plots.append(_plot_eval(before, after, out))

    # zero-variance steps take no learner compute: report compute over the steps that trained, and
    # wall-clock per policy version over the whole training phase
    step_s = [float(s["seconds"]) for s in steps if s.get("trajectories")]
    tok_s = [float(s["tokens_per_second"]) for s in steps if s.get("trajectories") and s.get("tokens_per_second")]
    rss = [int(s["rss_bytes"]) for s in steps if s.get("rss_bytes")]
    lines = ["# shellrl main job report", ""]
    lines += ["## Evaluation (greedy, fixed task instances, one episode each)", "",
              "| set | episodes | before | after | change |", "|---|---|---|---|---|"]
    for name in before:
        b, a = _rate(before[name]), _rate(after.get(name))
        delta = f"{100 * (a - b):+.1f} pts" if a is not None and b is not None else "n/a"
        lines.append(f"| {name} | {before[name].get('episodes_scored')} | {_fmt(b)} | {_fmt(a)} | {delta} |")
    lines += ["", f"Versions evaluated: before {before[next(iter(before))].get('policy_versions_seen')}, after "
              f"{after[next(iter(after))].get('policy_versions_seen') if after else 'n/a'}.", ""]
    lines += ["### Per template (eval_id and eval_ood)", "", "| template | before | after |", "|---|---|---|"]
    for name in ("eval_id", "eval_ood"):
        if name not in before:
            continue
        b, a = per_template(before[name], tasks_by_id), per_template(after.get(name, {}), tasks_by_id)
        for key in sorted(set(b) | set(a)):
            bb, aa = b.get(key, [0, 0]), a.get(key, [0, 0])
            lines.append(f"| {name}: {key} | {bb[0]}/{bb[1]} | {aa[0]}/{aa[1]} |")
    lines += ["", "## Training", "",
              f"- learner steps: {len(steps)} in {train_s / 60:.1f} min of training; whole job {total_s / 60:.1f} min",
              f"- wall-clock per policy version: {train_s / max(len(steps), 1):.1f} s "
              f"({sum(bool(s.get('trajectories')) for s in steps)} of {len(steps)} steps had a group with reward variance)",
              f"- learner compute of steps that trained: median {statistics.median(step_s):.1f} s, max {max(step_s):.1f} s"
              if step_s else "- learner compute of steps that trained: n/a (every group had zero variance)",
              f"- learner tokens/s (steps that trained): median {statistics.median(tok_s):.0f}" if tok_s
              else "- learner tokens/s: n/a",
              f"- learner RSS: first {rss[0] / 2**30:.2f} GiB, peak {max(rss) / 2**30:.2f} GiB, last {rss[-1] / 2**30:.2f} GiB"
              if rss else "- learner RSS: n/a",
              "- staleness at training time (p50/p90/p99 bucket bounds): "
              + " / ".join(str(quantile_from_buckets(stale, q)) for q in (0.5, 0.9, 0.99)),
              "- trained-batch reward by step: " + " ".join(f"{s.get('reward_mean', 0):.2f}" for s in steps),
              ""]
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += ["## Configuration", "", "```json", json.dumps(config, indent=2, default=str), "```", ""]
    example = next(iter(tasks_by_id.values()), None)
    if example is not None:
        lines += ["Example eval task:", "", "```json", json.dumps(task_to_json(example), indent=2)[:2000], "```", ""]
    (out / "report.md").write_text("\n".join(lines))
    (out / "evaluations.json").write_text(json.dumps({"before": before, "after": after}, default=str))
    (out / "steps.json").write_text(json.dumps(steps, default=str))
    return out / "report.md"
