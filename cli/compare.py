"""`shellrl report --compare DIR...`: several runs of the main job side by side, aggregated.

Input: report directories (or state directories holding `report/`). Each run's `summary.json`
(cli/run_summary.py) is read; a report written before summary.json existed is summarized from its
`evaluations.json`, templates parsed from the generated task ids. Output in `out`:
`compare.json` (everything below), `compare.md` (tables) and `compare.png` (cli/compare_plots.py).

Estimators (stated in both files):
* per eval set, before / after / change: the mean over runs with a Student-t 95% interval over
  runs (n - 1 degrees of freedom): the spread of what training does from seed to seed; with one
  run, that run's own interval (cli/eval_stats.py: Wilson over tasks for one episode per task, a
  bootstrap over tasks for several);
* per template: the mean solved instances before and after, how many runs lost any, and how many
  lost more than the tolerance (1 instance); each run's trajectory over its eval points and the
  step it first lost an instance, or never (cli/template_trajectories.py);
* the target (issue 20, item 4): the fraction of runs meeting it, and of each of its checks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from cli import compare_plots, template_trajectories
from cli.eval_stats import t_interval
from cli.run_summary import summarize, summary_line

ESTIMATOR = (
    "per run: mean pass rate over tasks (one greedy episode per task: the success rate; "
    "Wilson interval over tasks; several sampled episodes: percentile bootstrap over tasks); "
    "over runs: mean with a Student-t 95% interval (n - 1 dof); one run: its own interval"
)


def load_run(directory: Path) -> dict:
    """The summary of one run; ValueError naming the directory when it holds no report."""
    d = Path(directory)
    if (d / "report").is_dir() and not (d / "evaluations.json").exists():
        d = d / "report"
    if (d / "summary.json").exists():
        summary = {**json.loads((d / "summary.json").read_text()), "dir": str(directory)}
    elif (d / "evaluations.json").exists():
        evaluations = json.loads((d / "evaluations.json").read_text())
        meta = {"dir": str(directory), "seed": None, "note": "summarized from evaluations.json"}
        summary = summarize(
            evaluations["before"], evaluations["after"], None, meta, evaluations.get("during")
        )
    else:
        raise ValueError(
            f"{directory}: no summary.json or evaluations.json (not a report directory)"
        )
    if summary.get("incomplete"):
        raise ValueError(f"{directory}: an incomplete run ({summary.get('line')}): not comparable")
    if (summary.get("target") or {}).get("evaluated") is False:
        raise ValueError(
            f"{directory}: not evaluated after training ({summary_line(summary)}): not comparable"
        )
    summary = template_trajectories.ensure_trajectories(summary)
    return {**summary, "line": summary_line(summary)}


def aggregate(runs: list[dict]) -> dict:
    """compare.json's content (see the module docstring); `runs` from `load_run`."""
    sets = {}
    for name in dict.fromkeys(n for r in runs for n in r["sets"]):
        per = [r["sets"][name] for r in runs if name in r["sets"]]
        row = {w: _over_runs([p[w] for p in per]) for w in ("before", "after")}
        change = [p["after"]["rate"] - p["before"]["rate"] for p in per]
        mean, low, high = t_interval(change)
        row["change"] = {"mean": mean, "low": low, "high": high, "values": change}
        sets[name] = row
    templates: dict[str, dict] = {}
    for r in runs:
        for name, by_template in r["templates"].items():
            for key, t in by_template.items():
                e = templates.setdefault(name, {}).setdefault(
                    key, {"instances": 0, "before": [], "after": [], "lost_any": 0, "lost_more": 0}
                )
                e["instances"] = max(e["instances"], t["instances"])
                e["before"].append(t["before"])
                e["after"].append(t["after"])
                e["lost_any"] += t["before"] > 0 and t["before"] - t["after"] > 1e-9
                e["lost_more"] += t["before"] - t["after"] > 1.0 + 1e-9
    for by_template in templates.values():
        for e in by_template.values():
            e["before_mean"] = sum(e["before"]) / len(e["before"])
            e["after_mean"] = sum(e["after"]) / len(e["after"])
    checks = [k for k in runs[0]["target"] if k != "met"] if runs else []
    met = sum(bool(r["target"]["met"]) for r in runs)
    return {
        "estimator": ESTIMATOR,
        "runs": [
            {"dir": r["dir"], "seed": r.get("seed"), "target": r["target"], "line": r.get("line")}
            for r in runs
        ],
        "sets": sets,
        "templates": templates,
        "template_trajectories": template_trajectories.compare_rows(runs),
        "target": {
            "runs": len(runs),
            "runs_met": met,
            "fraction_met": met / len(runs) if runs else math.nan,
            "fraction_per_check": {
                c: sum(bool(r["target"].get(c)) for r in runs) / len(runs) for c in checks
            },
        },
    }


def _over_runs(scores: list[dict]) -> dict:
    values = [s["rate"] for s in scores]
    if len(scores) == 1:
        s = scores[0]
        return {"mean": s["rate"], "low": s["low"], "high": s["high"], "values": values}
    mean, low, high = t_interval(values)
    return {"mean": mean, "low": low, "high": high, "values": values}


def write_compare(dirs: list[Path], out: Path) -> dict:
    """Load the runs of `dirs`, aggregate, write compare.json, compare.md, compare.png to `out`."""
    runs = [load_run(d) for d in dirs]
    agg = aggregate(runs)
    out.mkdir(parents=True, exist_ok=True)
    agg["plot"] = compare_plots.plot_compare(agg, out)
    (out / "compare.json").write_text(json.dumps(finite_or_null(agg), indent=2))
    (out / "compare.md").write_text(markdown(agg))
    return agg


def markdown(agg: dict) -> str:
    """compare.md: the target verdicts, the per-set table and the per-template table."""
    t = agg["target"]
    lines = ["# shellrl runs compared", "", f"Estimator: {agg['estimator']}.", ""]
    lines += [
        f"Target met by {t['runs_met']} of {t['runs']} runs "
        f"({100 * t['fraction_met']:.0f}%); per check: "
        + ", ".join(f"{k} {100 * v:.0f}%" for k, v in t["fraction_per_check"].items()),
        "",
        "| run | seed | target | checks failed |",
        "|---|---|---|---|",
    ]
    for r in agg["runs"]:
        failed = [k for k, v in r["target"].items() if k != "met" and not v]
        verdict = "met" if r["target"]["met"] else "missed"
        lines.append(f"| {r['dir']} | {r['seed']} | {verdict} | {', '.join(failed) or '-'} |")
    lines += ["", "| set | runs | before | after | change (pts) |", "|---|---|---|---|---|"]
    for name, row in agg["sets"].items():
        n = len(row["after"]["values"])
        lines.append(
            f"| {name} | {n} | {_interval(row['before'])} | {_interval(row['after'])} | "
            f"{_interval(row['change'], signed=True)} |"
        )
    lines += [
        "",
        "| set: template | instances | before (mean) | after (mean) | per run after | "
        "runs losing any / > 1 |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_template in agg["templates"].items():
        for key, e in sorted(by_template.items()):
            per_run = " ".join(f"{v:g}" for v in e["after"])
            lines.append(
                f"| {name}: {key} | {e['instances']} | {e['before_mean']:.2f} | "
                f"{e['after_mean']:.2f} | {per_run} | {e['lost_any']} / {e['lost_more']} |"
            )
    lines += [
        "",
        "Per template over training: the step at which each run first solved fewer instances "
        "than its base policy, and its solved/instances at each evaluation.",
        "",
    ]
    lines += template_trajectories.compare_markdown(agg["template_trajectories"])
    lines += [f"![compare]({agg.get('plot', 'compare.png')})", ""]
    return "\n".join(lines)


def _interval(row: dict, signed: bool = False) -> str:
    mean, low, high = row["mean"], row["low"], row["high"]
    if not math.isfinite(mean):
        return "n/a"
    fmt = "{:+.1f}" if signed else "{:.1f}"
    text = fmt.format(100 * mean) + ("" if signed else "%")
    if math.isfinite(low) and math.isfinite(high):
        text += f" [{fmt.format(100 * low)}, {fmt.format(100 * high)}]"
    return text


def finite_or_null(value):
    """`value` with every NaN or infinite float replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value
