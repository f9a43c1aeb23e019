"""KL to the initial policy per training template over steps (issue 33 item 1), for report.md.

Input: the learner's step records (steps.json, from its ledger), whose `kl_by_template` is
`{template: {"kl": mean k3 KL(pi || ref) per scored token, "tokens": int, "trajectories": int}}`
over the trajectories the step trained on (services/learner/template_kl.py), under the weights
the step started from. A template appears at the steps that trained on it; records written before
this field, or by a learner without a reference (kl_coef = 0), have none and the section says so.
`plot` draws every template's series (kl_by_template.png).
"""

from __future__ import annotations

from pathlib import Path

from cli.report_plots import plt  # matplotlib with the Agg backend

MAX_POINTS = 10  # steps shown per template in report.md (steps.json keeps every one)


def kl_series(steps: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{template: [(step, kl per token), ...]} in step order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for s in steps:
        for template, entry in (s.get("kl_by_template") or {}).items():
            out.setdefault(template, []).append((int(s["step"]), float(entry["kl"])))
    return {t: sorted(points) for t, points in sorted(out.items())}


def thinned(points: list, n: int = MAX_POINTS) -> list:
    """At most n of `points`, evenly spaced, the first and the last always kept."""
    if len(points) <= n:
        return points
    picks = sorted({round(i * (len(points) - 1) / (n - 1)) for i in range(n)})
    return [points[i] for i in picks]


def markdown_section(steps: list[dict]) -> list[str]:
    """report.md's table: per training template, the KL to the initial policy at the steps that
    trained on it (at most MAX_POINTS of them), and its largest value with the step."""
    series = kl_series(steps)
    lines = [
        "### KL to the initial policy per training template (k3, nats per scored token)",
        "",
    ]
    if not series:
        return [*lines, "Not recorded (no reference policy, or a learner before it).", ""]
    lines += [
        "| template | steps trained on it | KL by step (step: KL) | largest (step) |",
        "|---|---|---|---|",
    ]
    for template, points in series.items():
        step, kl = max(points, key=lambda p: p[1])
        shown = ", ".join(f"{s}: {v:.3g}" for s, v in thinned(points))
        lines.append(f"| {template} | {len(points)} | {shown} | {kl:.3g} ({step}) |")
    return [*lines, "", "Every step in steps.json (`kl_by_template`).", ""]


def plot(steps: list[dict], out: Path) -> str | None:
    """kl_by_template.png: KL per scored token against step, one line per training template
    (markers at the steps that trained on it); None when no step recorded any."""
    series = kl_series(steps)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for template, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=template)
    ax.set_xlabel("step")
    ax.set_ylabel("k3 KL to the initial policy (nats / token)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "kl_by_template.png", dpi=110)
    plt.close(fig)
    return "kl_by_template.png"
