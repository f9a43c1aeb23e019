"""Every eval template over training (issue 33 item 1): its solved instances at each eval point of
a run and the step at which it first lost an instance, for summary.json, report.md and
`shellrl report --compare`.

Eval points are a run's evaluations in order: `before` (the policy training starts from), any
evaluations `during` training, `after`. Each is placed at the policy version it ran on (the
largest of its views' `policy_versions_seen`; a version is the optimizer steps taken, so it is
the step). A template's `trajectory` is `[{"step": int, "solved": float}, ...]` in step order,
solved being the sum of its tasks' pass rates (instances solved with one episode per task,
cli/eval_stats.py); `lost_at_step` is the step of the first point after the first whose solved
is below the first point's (the base policy's) by any amount, or None ("never").

The job evaluates before and after, and during training every `--eval-every-steps` steps (off by
default): with evaluations during training a loss is dated to the first evaluation that shows it.
A lost template's entry gets `lost_episodes` (`lost_episodes`): one task it solved at the point
before the loss and failed at that point, with the two episodes' ids for `shellrl show`.
"""

from __future__ import annotations

from cli.eval_stats import template_of, template_scores

TOLERANCE = 1e-9  # solved values are sums of pass rates: compare with this slack


def eval_step(views: dict[str, dict] | None) -> int | None:
    """The policy version (= step) an evaluation point ran on: the largest version any of its
    views saw (`policy_versions_seen`, else `policy_version`); None when it holds no view."""
    versions = []
    for view in (views or {}).values():
        seen = view.get("policy_versions_seen") or []
        versions += [int(v) for v in seen] or (
            [int(view["policy_version"])] if view.get("policy_version") is not None else []
        )
    return max(versions) if versions else None


def lost_at_step(trajectory: list[dict]) -> int | None:
    """The step of the first point whose solved is below the first point's; None: never."""
    if not trajectory:
        return None
    base = trajectory[0]["solved"]
    return next(
        (p["step"] for p in trajectory[1:] if p["solved"] < base - TOLERANCE),
        None,
    )


def add_trajectories(
    templates: dict[str, dict[str, dict]],
    points: list[dict[str, dict]],
    tasks_by_id: dict | None,
) -> None:
    """Add `trajectory` and `lost_at_step` to every template entry of summary.json's
    `templates` ({set: {template: entry}}), in place. points: the run's evaluations in order,
    each {set: evaluation view}; an empty point (an evaluation that did not run) is left out."""
    placed = [(eval_step(p), p) for p in points if p]
    placed = [(step if step is not None else i, p) for i, (step, p) in enumerate(placed)]
    for name, by_template in templates.items():
        views = [(step, p[name]) for step, p in placed if name in p]
        scores = [(step, template_scores(v, tasks_by_id)) for step, v in views]
        for key, entry in by_template.items():
            trajectory = [
                {"step": step, "solved": s.get(key, {}).get("solved", 0.0)} for step, s in scores
            ]
            entry["trajectory"] = trajectory
            entry["lost_at_step"] = lost_at_step(trajectory)
            if entry["lost_at_step"] is not None:
                i = next(i for i, p in enumerate(trajectory) if p["step"] == entry["lost_at_step"])
                entry["lost_episodes"] = lost_episodes(key, views[i - 1], views[i], tasks_by_id)


def lost_episodes(
    template: str, before: tuple[int, dict], after: tuple[int, dict], tasks_by_id: dict | None
) -> dict | None:
    """One task of `template` that an evaluation point solved and the next one did not, with an
    episode of each (`shellrl show <trajectory_id>` prints them while the stack's Redis keeps
    them): {"task_id", "before_step", "before": trajectory id of a success, "after_step", "after":
    trajectory id of a failure (a wrong answer if any)}, the task whose successes dropped most;
    None when no such pair of episodes exists (e.g. results without trajectory ids).
    before, after: (step, evaluation view) of the two points."""

    def episodes(view: dict) -> dict[str, dict[str, list[str]]]:
        out: dict[str, dict[str, list[str]]] = {}
        for r in view.get("results", []):
            tid, task_id = r.get("trajectory_id"), r.get("task_id")
            if not tid or not task_id or template_of(task_id, tasks_by_id) != template:
                continue
            kind = r.get("outcome") if r.get("outcome") in ("success", "wrong") else "other"
            out.setdefault(task_id, {"success": [], "wrong": [], "other": []})[kind].append(tid)
        return out

    was, now = episodes(before[1]), episodes(after[1])
    candidates = [
        (len(was[t]["success"]) - len(now[t]["success"]), t)
        for t in was
        if t in now and was[t]["success"] and (now[t]["wrong"] or now[t]["other"])
    ]
    if not candidates:
        return None
    _, task_id = max(candidates, key=lambda c: c[0])
    return {
        "task_id": task_id,
        "before_step": before[0],
        "before": was[task_id]["success"][0],
        "after_step": after[0],
        "after": (now[task_id]["wrong"] + now[task_id]["other"])[0],
    }


def ensure_trajectories(summary: dict) -> dict:
    """A summary written before trajectories existed gets the two points it has: `before` at
    step 0 and `after` at the run's `steps` (summary.json's meta; None when unknown)."""
    for by_template in summary.get("templates", {}).values():
        for entry in by_template.values():
            if "trajectory" in entry:
                continue
            entry["trajectory"] = [{"step": 0, "solved": entry["before"]}]
            if entry.get("after") is not None:
                entry["trajectory"].append({"step": summary.get("steps"), "solved": entry["after"]})
            entry["lost_at_step"] = lost_at_step(entry["trajectory"])
    return summary


def trajectory_text(trajectory: list[dict], instances: int) -> str:
    """`0: 2/3, 37: 0/3` (step: solved/instances per point)."""
    return ", ".join(f"{p['step']}: {_n(p['solved'])}/{instances}" for p in trajectory)


def lost_text(step: int | None) -> str:
    return "never" if step is None else str(step)


def markdown_section(templates: dict[str, dict[str, dict]]) -> list[str]:
    """report.md's table: every eval template's solved instances at each eval point and the
    step at which it first lost one."""
    lines = [
        "### Per template over training (step: solved/instances at each evaluation)",
        "",
        "| set: template | solved by step | lost an instance at step |",
        "|---|---|---|",
    ]
    shows = []
    for name, by_template in templates.items():
        for key, e in sorted(by_template.items()):
            lines.append(
                f"| {name}: {key} | {trajectory_text(e['trajectory'], e['instances'])} | "
                f"{lost_text(e['lost_at_step'])} |"
            )
            if ep := e.get("lost_episodes"):
                shows.append(
                    f"- {name}: {key}, task `{ep['task_id']}`: solved at step "
                    f"{ep['before_step']} (`shellrl show {ep['before']}`), failed at step "
                    f"{ep['after_step']} (`shellrl show {ep['after']}`)"
                )
    if shows:
        lines += ["", "Episodes of each lost template, before and after the loss:", "", *shows]
    return [*lines, ""]


def compare_rows(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Per set and template over runs: each run's trajectory and lost_at_step (None: never),
    and how many runs lost an instance; runs from cli/compare.load_run."""
    out: dict[str, dict[str, dict]] = {}
    for r in runs:
        for name, by_template in ensure_trajectories(r)["templates"].items():
            for key, e in by_template.items():
                row = out.setdefault(name, {}).setdefault(
                    key, {"instances": 0, "trajectories": [], "lost_at_step": [], "runs_lost": 0}
                )
                row["instances"] = max(row["instances"], e["instances"])
                row["trajectories"].append(e["trajectory"])
                row["lost_at_step"].append(e["lost_at_step"])
                row["runs_lost"] += e["lost_at_step"] is not None
    return out


def compare_markdown(rows: dict[str, dict[str, dict]]) -> list[str]:
    """compare.md's table: per template, each run's trajectory and the step it lost an instance."""
    lines = [
        "| set: template | instances | runs that lost an instance | lost at step, per run | "
        "solved by step, per run |",
        "|---|---|---|---|---|",
    ]
    for name, by_template in rows.items():
        for key, row in sorted(by_template.items()):
            n = row["instances"]
            lost = ", ".join(lost_text(s) for s in row["lost_at_step"])
            paths = " / ".join(trajectory_text(t, n) for t in row["trajectories"])
            lines.append(
                f"| {name}: {key} | {n} | {row['runs_lost']} of {len(row['lost_at_step'])} | "
                f"{lost} | {paths} |"
            )
    return [*lines, ""]


def _n(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < TOLERANCE else f"{x:.2f}"
