"""An experiment's report: the table (rich for the terminal, Markdown for report.md), two PNG
figures, results.json, under `<state>/experiments/<name>/`.

* `<name>_vs_wall_clock.png`: trained tokens (cumulative) and episodes finished (cumulative)
  against seconds since the tasks were submitted, one line per point;
* `<name>_vs_trained_tokens.png`: the trained batch's mean reward and mean staleness against
  trained tokens (cumulative), one line per point.
A step that trained nothing has no staleness: NaN, drawn as a gap.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import matplotlib
from rich.table import Table

from cli.experiments.measure import PointResult, cumulative_tokens, in_window, summarize
from cli.experiments.workload import Experiment

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = (
    "setting",
    "episodes/min",
    "mean episode s",
    "slot utilisation",
    "learner steps",
    "trained tokens",
    "tokens/s",
    "vs first: episodes/min, tokens/s",
    "staleness mean / max",
    "dropped stale",
    "failed episodes",
)


def _num(value: float, fmt: str) -> str:
    return (
        "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt % value
    )


def _ratio(value: float, first: float) -> float:
    return value / first if first and math.isfinite(first) and math.isfinite(value) else math.nan


def table_rows(results: list[PointResult]) -> list[list[str]]:
    """One row of COLUMNS per point, in order."""
    summaries = [summarize(r) for r in results]
    rows = []
    for r, s in zip(results, summaries):
        ratios = [_ratio(s[key], summaries[0][key]) for key in ("episodes_per_min", "tokens_per_s")]
        rows.append(
            [
                r.name,
                _num(s["episodes_per_min"], "%.1f"),
                _num(s["episode_s_mean"], "%.2f"),
                _num(100 * s["utilisation"], "%.1f%%"),
                str(s["learner_steps"]),
                str(s["trained_tokens"]),
                _num(s["tokens_per_s"], "%.1f"),
                ", ".join(_num(x, "%.2fx") for x in ratios),
                f"{_num(s['staleness_mean'], '%.2f')} / {_num(s['staleness_max'], '%.0f')}",
                _num(s["dropped_stale"], "%.0f"),
                str(s["failures"]),
            ]
        )
    return rows


def rich_table(exp: Experiment, results: list[PointResult]) -> Table:
    table = Table(title=exp.title)
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in table_rows(results):
        table.add_row(*row)
    return table


def markdown_table(results: list[PointResult]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return lines + ["| " + " | ".join(row) + " |" for row in table_rows(results)]


def _series(result: PointResult) -> dict[str, list[float]]:
    steps, episodes = in_window(result)
    ends = sorted(e.end_s for e in episodes)
    tokens = [float(t) for t in cumulative_tokens(steps)]
    w = result.window_s
    # the cumulative series run from (0 s, 0) to the window's end: every point is a whole line
    return {
        "step_wall_s": [0.0] + [s.wall_s for s in steps] + [w],
        "tokens_from_0": [0.0] + tokens + [tokens[-1] if tokens else 0.0],
        "tokens": tokens,
        "reward": [s.reward_mean for s in steps],
        "staleness": [s.staleness_mean if s.trajectories else math.nan for s in steps],
        "episode_end_s": [0.0] + ends + [w],
        "episodes": [float(i) for i in range(len(ends) + 1)] + [float(len(ends))],
    }


def _figure(panels, out: Path, name: str, steps: tuple[bool, ...] = ()) -> str:
    """panels: [(title, x label, y label, [(label, xs, ys)])] -> one PNG side by side; a panel
    whose `steps` entry is True draws cumulative counts as steps."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for i, (ax, (title, xlabel, ylabel, lines)) in enumerate(zip(axes[0], panels)):
        style = {"drawstyle": "steps-post"} if i < len(steps) and steps[i] else {}
        for label, xs, ys in lines:
            ax.plot(xs, ys, "o-", ms=2.5, label=label, **style)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def plot(exp: Experiment, results: list[PointResult], out: Path) -> list[str]:
    """The two figures (module docstring); returns their file names."""
    series = [(r.name, _series(r)) for r in results]
    wall = "seconds since the tasks were submitted"
    tokens = "trained tokens (loss tokens, cumulative)"
    return [
        _figure(
            [
                (
                    f"{exp.name}: trained tokens",
                    wall,
                    "trained tokens",
                    [(n, s["step_wall_s"], s["tokens_from_0"]) for n, s in series],
                ),
                (
                    f"{exp.name}: episodes finished",
                    wall,
                    "episodes",
                    [(n, s["episode_end_s"], s["episodes"]) for n, s in series],
                ),
            ],
            out,
            f"{exp.name}_vs_wall_clock.png",
            steps=(True, True),
        ),
        _figure(
            [
                (
                    f"{exp.name}: reward of the trained batch",
                    tokens,
                    "mean reward",
                    [(n, s["tokens"], s["reward"]) for n, s in series],
                ),
                (
                    f"{exp.name}: staleness of the trained batch",
                    tokens,
                    "mean staleness (policy versions)",
                    [(n, s["tokens"], s["staleness"]) for n, s in series],
                ),
            ],
            out,
            f"{exp.name}_vs_trained_tokens.png",
        ),
    ]


def write_report(out: Path, exp: Experiment, results: list[PointResult], run_info: dict) -> Path:
    """report.md, results.json and the figures in `out`; returns report.md's path.
    run_info: how it ran (command, model, device, cores, seconds), shown in the report."""
    out.mkdir(parents=True, exist_ok=True)
    images = plot(exp, results, out)
    lines = [
        f"# shellrl experiment {exp.name}",
        "",
        exp.title + ".",
        "",
        f"Ran on {run_info.get('device', 'cpu')} ({os.cpu_count()} CPU cores) with model "
        f"`{run_info.get('model_path', 'tiny')}`, in {run_info.get('seconds', 0):.0f} s: "
        f"`{run_info.get('command', '')}`",
        "",
        *markdown_table(results),
        "",
        "Episodes/min and tokens/s count what ended within the window; slot utilisation = "
        "episode-seconds inside the window / (slots x window), where slots are the point's "
        "environments or in-flight cap; staleness is the learner's (its version at training "
        "minus the trajectory's oldest action version), over the trained trajectories."
        + (
            " The tiny random model solves no task: its reward curves are flat at 0 (run with "
            "--model-path smollm2 for a reward that moves)."
            if run_info.get("model_path", "tiny") == "tiny"
            else ""
        ),
        "",
        *[f"![{name}]({name})" for name in images],
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    (out / "results.json").write_text(
        json.dumps(
            {
                "experiment": exp.name,
                "title": exp.title,
                "scale": exp.scale,
                "window_s": exp.window_s,
                "meta": exp.meta,
                "run": run_info,
                "tasks": list(exp.tasks),
                "env": exp.env,
                "points": [asdict(r) | {"summary": summarize(r)} for r in results],
            },
            indent=1,
            default=str,
        )
    )
    return out / "report.md"
