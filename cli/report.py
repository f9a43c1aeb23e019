"""The main job's report: PNG plots (cli/report_plots.py) and `report.md` under `<state>/report/`.

Inputs: the evaluations before/after (GET /v1/evaluations/{id} views), the learner's step ledger
(`steps.jsonl`: reward_mean, success_rate, seconds, tokens_per_second, rss_bytes, finished_at per
step), the status snapshots taken while training (`time`, learner and rollout status, the
engine's generated-token counter), and the final /metrics texts of learner and rollout.
Success rates are reported with their n and a 95% interval (cli/eval_stats.py: Wilson over tasks
for one episode per task, a bootstrap over tasks for several); `summary` (cli/run_summary.py)
adds the target verdict and the per-template regressions. A few successes and failures per
template of the last evaluation are named by trajectory id, for `shellrl show`.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from cli import job_eval_kl, template_kl
from cli import report_plots as plots
from cli.eval_stats import set_score
from cli.report_timing import timing, timing_section
from cli.stack_status import histogram_buckets, quantile_from_buckets
from cli.template_trajectories import markdown_section
from shellrl.contract import task_to_json


def _rate(view: dict | None) -> float | None:
    return None if not view else view.get("success_rate")


def per_template(view: dict, tasks_by_id: dict) -> dict[str, list[int]]:
    """{template or source: [successes, episodes]} from an evaluation's per-episode results."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in view.get("results", []):
        task = tasks_by_id.get(r.get("task_id"))
        key = (task.template or task.source or "?") if task is not None else "?"
        out[key][1] += 1
        out[key][0] += int(r.get("outcome") == "success")
    return dict(out)


def transcript_examples(view: dict, tasks_by_id: dict, k: int = 2) -> dict[str, dict]:
    """{template or source: {"success": [trajectory_id ...], "failure": [...]}}, at most `k` of
    each, in result order, from an evaluation's per-episode results (`shellrl show <id>` prints
    one). A failure is a wrong answer first (outcome `wrong`), an infrastructure failure only where
    a template has fewer than `k` wrong answers."""
    found: dict[str, dict[str, list[str]]] = defaultdict(
        lambda: {"success": [], "wrong": [], "infra": []}
    )
    for r in view.get("results", []):
        if not r.get("trajectory_id"):
            continue
        task = tasks_by_id.get(r.get("task_id"))
        key = (task.template or task.source or "?") if task is not None else "?"
        outcome = r.get("outcome")
        kind = outcome if outcome in ("success", "wrong") else "infra"
        found[key][kind].append(r["trajectory_id"])
    return {
        key: {"success": f["success"][:k], "failure": (f["wrong"] + f["infra"])[:k]}
        for key, f in sorted(found.items())
    }


def _transcripts_section(before: dict, after: dict, tasks_by_id: dict) -> list[str]:
    """A few successes and failures per template of the last evaluation that ran, as the
    `shellrl show` commands that print them (GET /v1/trajectories/{id} while the stack's Redis
    keeps them)."""
    views = after or before
    lines = []
    for name in ("eval_id", "eval_ood", *sorted(set(views) - {"eval_id", "eval_ood"})):
        if name not in views:
            continue
        for key, ids in transcript_examples(views[name], tasks_by_id).items():
            shown = [f"`{i}` ({kind})" for kind in ("success", "failure") for i in ids[kind]]
            if shown:
                lines.append(f"| {name}: {key} | {', '.join(shown)} |")
    if not lines:
        return []
    when = "after" if after else "before"
    return [
        f"### Transcripts ({when} training): `shellrl show <trajectory_id>`",
        "",
        "| set: template | trajectories |",
        "|---|---|",
        *lines,
        "",
    ]


def _summary_section(summary: dict | None) -> list[str]:
    """The target verdict, the summary line and the table of templates that lost instances."""
    if not summary:
        return []
    lines = ["### Target and regressions", "", f"`{summary['line']}`", ""]
    if summary["regressions"]:
        lines += ["| set: template | instances | before | after | beyond 1 instance |"]
        lines += ["|---|---|---|---|---|"]
        for r in summary["regressions"]:
            lines.append(
                f"| {r['set']}: {r['template']} | {r['instances']} | {r['before']:g} | "
                f"{r['after']:g} | {'yes' if r['beyond_tolerance'] else 'no'} |"
            )
        lines.append("")
    return lines


def _incomplete_section(incomplete: dict | None) -> list[str]:
    """The head of the report of a job a dead service cut short (summary.json's `incomplete`)."""
    if not incomplete:
        return []
    cause = f"; last error: `{incomplete['cause']}`" if incomplete.get("cause") else ""
    return [
        f"**Incomplete run**: {incomplete.get('service')} exited with status "
        f"{incomplete.get('status')} during {incomplete.get('phase')}: {incomplete.get('class')}"
        f"{cause}; log {incomplete.get('log')}. What follows is what ran until then; "
        f"{incomplete.get('rerun') or 'see the log'}.",
        "",
    ]


def _with_interval(view: dict | None) -> str:
    rate, n, lo, hi = plots.eval_bar(view)
    if n == 0 or rate != rate:
        return "n/a"
    return f"{100 * rate:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def write_report(
    out: Path,
    *,
    config: dict,
    before: dict,
    after: dict,
    steps: list[dict],
    snapshots: list[dict],
    learner_metrics: str,
    rollout_metrics: str,
    train_s: float,
    total_s: float,
    tasks_by_id: dict,
    train_started_at: float | None = None,
    summary: dict | None = None,
    engine_metrics: str = "",
    phases: dict | None = None,
    during: list[dict] | None = None,
) -> Path:
    """Write report.md, the PNG plots, evaluations.json, steps.json and timing.json into `out`;
    returns the path of report.md. train_started_at: Unix time training started (the wall-clock
    axis' 0); summary: the run's summary.json content (its target verdict and regressions are
    shown); engine_metrics and phases ({"<phase>_s": seconds}): with the learner's and rollout's
    metrics, where the time went (cli/report_timing.py); during: the evaluations during training
    ({set: view} each, in order), in evaluations.json."""
    out.mkdir(parents=True, exist_ok=True)
    # keep only the last record of each step (a resume rewrites rolled-back steps)
    by_step = {}
    for s in steps:
        if "step" in s and "event" not in s:
            by_step[s["step"]] = s
    steps = [by_step[k] for k in sorted(by_step)]
    wall = plots.wall_clock_min(steps, snapshots, train_started_at)
    images = plots.plot_curves(steps, wall, out) if steps else []
    if steps:
        rollout = plots.rollout_throughput(snapshots, train_started_at)
        images.append(plots.plot_throughput(steps, wall, rollout, out))
    stale = histogram_buckets(learner_metrics, "shellrl_trajectory_staleness")
    if (p := plots.plot_staleness(stale, out)) is not None:
        images.append(p)
    if (p := template_kl.plot(steps, out)) is not None:
        images.append(p)
    if before and after:  # a job cut short plots no bar for an evaluation that did not run
        images.append(plots.plot_eval(before, after, out))

    # zero-variance steps take no learner compute: report compute over the steps that trained, and
    # wall-clock per policy version over the whole training phase
    step_s = [float(s["seconds"]) for s in steps if s.get("trajectories")]
    tok_s = [
        float(s["tokens_per_second"])
        for s in steps
        if s.get("trajectories") and s.get("tokens_per_second")
    ]
    rss = [int(s["rss_bytes"]) for s in steps if s.get("rss_bytes")]
    lines = ["# shellrl main job report", ""]
    lines += _incomplete_section((summary or {}).get("incomplete"))
    first = set_score(next(iter(before.values()), None))
    lines += [
        "## Evaluation (greedy, fixed task instances, one episode each)"
        if first.samples_per_task <= 1
        else f"## Evaluation (fixed task instances, {first.samples_per_task} sampled episodes each)",
        "",
        f"Success (mean pass rate over tasks) with its 95% interval ({first.estimator}); "
        "n = episodes scored.",
        "",
        "| set | n | before | after | change |",
        "|---|---|---|---|---|",
    ]
    not_evaluated = "not evaluated"
    for name in before:
        b, a = _rate(before[name]), _rate(after.get(name))
        delta = f"{100 * (a - b):+.1f} pts" if a is not None and b is not None else "n/a"
        n = before[name].get("episodes_scored")
        a_text = _with_interval(after.get(name)) if after else not_evaluated
        lines.append(f"| {name} | {n} | {_with_interval(before[name])} | {a_text} | {delta} |")
    if not before:
        lines.append(f"| (every set) | 0 | {not_evaluated} | {not_evaluated} | n/a |")
    versions = {
        when: views[next(iter(views))].get("policy_versions_seen") if views else not_evaluated
        for when, views in (("before", before), ("after", after))
    }
    lines += [
        "",
        f"Versions evaluated: before {versions['before']}, after {versions['after']}.",
        "",
    ]
    lines += _summary_section(summary)
    lines += [
        "### Per template (eval_id and eval_ood)",
        "",
        "| template | before | after |",
        "|---|---|---|",
    ]
    for name in ("eval_id", "eval_ood"):
        if name not in before:
            continue
        b, a = (
            per_template(before[name], tasks_by_id),
            per_template(after.get(name, {}), tasks_by_id),
        )
        for key in sorted(set(b) | set(a)):
            bb, aa = b.get(key, [0, 0]), a.get(key, [0, 0])
            a_text = f"{aa[0]}/{aa[1]}" if after else not_evaluated
            lines.append(f"| {name}: {key} | {bb[0]}/{bb[1]} | {a_text} |")
    lines += [""]
    if summary and summary.get("templates"):
        lines += markdown_section(summary["templates"])
    lines += _transcripts_section(before, after, tasks_by_id)
    lines += [
        "## Training",
        "",
        f"- learner steps: {len(steps)} in {train_s / 60:.1f} min of training; whole job {total_s / 60:.1f} min",
        f"- wall-clock per policy version: {train_s / max(len(steps), 1):.1f} s "
        f"({sum(bool(s.get('trajectories')) for s in steps)} of {len(steps)} steps had a group with reward variance)",
        f"- learner compute of steps that trained: median {statistics.median(step_s):.1f} s, max {max(step_s):.1f} s"
        if step_s
        else "- learner compute of steps that trained: n/a (every group had zero variance)",
        f"- learner tokens/s (steps that trained): median {statistics.median(tok_s):.0f}"
        if tok_s
        else "- learner tokens/s: n/a",
        f"- learner RSS: first {rss[0] / 2**30:.2f} GiB, peak {max(rss) / 2**30:.2f} GiB, "
        f"last {rss[-1] / 2**30:.2f} GiB"
        if rss
        else "- learner RSS: n/a",
        "- staleness at training time (p50/p90/p99 bucket bounds): "
        + " / ".join(str(quantile_from_buckets(stale, q)) for q in (0.5, 0.9, 0.99)),
        "- trained-batch reward by step ('-': no scored trajectory): "
        + " ".join(f"{s.get('reward_mean', 0):.2f}" if plots.scored(s) else "-" for s in steps),
        "",
    ]
    lines += template_kl.markdown_section(steps)
    lines += job_eval_kl.markdown_section((summary or {}).get("eval_kl") or [])
    time_spent = timing(
        phases or {"train_s": train_s}, learner_metrics, rollout_metrics, engine_metrics
    )
    (out / "timing.json").write_text(json.dumps(time_spent, indent=2))
    lines += timing_section(time_spent)
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in images] + [""]
    lines += [
        "## Configuration",
        "",
        "```json",
        json.dumps(config, indent=2, default=str),
        "```",
        "",
    ]
    example = next(iter(tasks_by_id.values()), None)
    if example is not None:
        lines += [
            "Example eval task:",
            "",
            "```json",
            json.dumps(task_to_json(example), indent=2)[:2000],
            "```",
            "",
        ]
    (out / "report.md").write_text("\n".join(lines))
    (out / "evaluations.json").write_text(
        json.dumps({"before": before, "after": after, "during": during or []}, default=str)
    )
    (out / "steps.json").write_text(json.dumps(steps, default=str))
    return out / "report.md"
