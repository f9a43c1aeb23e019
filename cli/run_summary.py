"""One run's outcome as data (`summary.json` of the report) and as the job's summary line.

The target (issue 20, item 4): `eval_id` at least doubles and gains >= 10 points, no template of
eval_id or eval_ood loses more than 1 of its instances (in solved instances: the sum of its tasks'
pass rates, cli/eval_stats.py), and `eval_ood` does not fall. Regressions are reported per
template, flagged when a template the base policy solves (before > 0) drops at all, and marked
beyond tolerance when it drops by more than `MAX_TEMPLATE_LOSS` instances.

    eval_id 18.8% -> 43.8% (2.33x, +25.0 pts) | eval_ood 6.2% -> 6.2% | target met |
    regressions: count_lines 4/10 -> 3/10

A job cut short by a service that died (cli/main_job.py) has `incomplete` in its meta; its
summary says "not evaluated" (`after: null`, target `{"met": false, "evaluated": false}`) for the
evaluations that did not run, never a number:

    incomplete: learner killed (SIGKILL) during train, no checkpoint | eval_id 18.8% -> not
    evaluated | eval_ood 6.2% -> not evaluated | target not evaluated

So is a job whose last evaluation of eval_id or eval_ood scored no episode (every one an INFRA
failure: an engine that stopped answering); summary.json's `unscored` gives the outcomes:

    eval_id 18.8% -> not evaluated (no episode scored: 64 infra_engine) | ...

`cli/compare.py` aggregates the summaries of several runs (complete ones only).
"""

from __future__ import annotations

import math
from dataclasses import asdict

from cli.eval_stats import set_score, template_scores
from cli.template_trajectories import add_trajectories

MIN_FACTOR = 2.0  # eval_id after >= 2 x before
MIN_GAIN = 0.10  # and >= +10 points
MAX_TEMPLATE_LOSS = 1.0  # instances a template may lose
TEMPLATE_SETS = ("eval_id", "eval_ood")


def summarize(
    before: dict,
    after: dict | None,
    tasks_by_id: dict | None,
    meta: dict,
    during: list[dict] | None = None,
) -> dict:
    """summary.json: per eval set before/after scores, per template solved instances with their
    trajectory over the eval points (before, `during` ({set: view} each, in order), after) and
    the step each first lost an instance (cli/template_trajectories.py), the regressions, the
    target verdict, and `meta` (seed, steps, settings) as given. An evaluation
    that did not run (`before` or `after` empty: a job cut short), or whose `after` scored no
    episode of eval_id or eval_ood (`unscored_sets`), is not evaluated: its sets' and templates'
    `after` is None, no regressions, target {"met": False, "evaluated": False}."""
    after = after or {}
    unscored = unscored_sets(before, after)
    evaluated = bool(before) and bool(after) and not unscored
    sets = {
        name: {
            "before": asdict(set_score(view)),
            "after": asdict(set_score(after.get(name))) if evaluated else None,
        }
        for name, view in before.items()
    }
    templates = {}
    for name in TEMPLATE_SETS:
        if name not in before:
            continue
        b = template_scores(before[name], tasks_by_id)
        a = template_scores(after.get(name), tasks_by_id)
        templates[name] = {
            key: {
                "instances": max(
                    b.get(key, {}).get("instances", 0), a.get(key, {}).get("instances", 0)
                ),
                "before": b.get(key, {}).get("solved", 0.0),
                "after": a.get(key, {}).get("solved", 0.0) if evaluated else None,
            }
            for key in sorted(set(b) | set(a))
        }
    add_trajectories(templates, [before, *(during or []), after if evaluated else {}], tasks_by_id)
    found = regressions(templates) if evaluated else []
    return {
        **meta,
        **({"unscored": unscored} if unscored else {}),
        "sets": sets,
        "templates": templates,
        "regressions": found,
        "target": target(sets, found) if evaluated else {"met": False, "evaluated": False},
    }


def unscored_sets(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """{set: {outcome: episodes}} of each set of TEMPLATE_SETS that the `after` evaluation ran
    but scored no episode of (every one an INFRA failure, e.g. `infra_engine` from an engine
    that stopped answering): that set was not evaluated, so its templates must not count as
    lost (before: "count_lines 4/10 -> 0/10 !" for a run whose engine died in training)."""
    out = {}
    for name in TEMPLATE_SETS:
        view = after.get(name)
        if name not in before or not view or set_score(view).episodes:
            continue
        outcomes: dict[str, int] = {}
        for r in view.get("results", []):
            outcomes[r.get("outcome") or "none"] = outcomes.get(r.get("outcome") or "none", 0) + 1
        out[name] = outcomes
    return out


def regressions(templates: dict[str, dict[str, dict]]) -> list[dict]:
    """Templates the base policy solved (before > 0) that solve fewer instances after."""
    out = []
    for name, by_template in templates.items():
        for key, t in by_template.items():
            loss = t["before"] - t["after"]
            if t["before"] > 0 and loss > 1e-9:
                out.append(
                    {
                        "set": name,
                        "template": key,
                        **t,
                        "beyond_tolerance": loss > MAX_TEMPLATE_LOSS + 1e-9,
                    }
                )
    return out


def target(sets: dict, found: list[dict]) -> dict:
    """The target's four checks and whether all hold (False when eval_id or eval_ood is absent)."""

    def rate(name: str, when: str) -> float:
        return (sets.get(name) or {}).get(when, {}).get("rate", math.nan)

    b_id, a_id = rate("eval_id", "before"), rate("eval_id", "after")
    b_ood, a_ood = rate("eval_ood", "before"), rate("eval_ood", "after")
    checks = {
        "eval_id_doubles": a_id >= MIN_FACTOR * b_id,
        "eval_id_gains_10_points": a_id - b_id >= MIN_GAIN - 1e-9,
        "no_template_loses_more_than_1": not any(r["beyond_tolerance"] for r in found),
        "eval_ood_does_not_fall": a_ood >= b_ood - 1e-9,
    }
    return {"met": all(checks.values()), **checks}


def summary_line(summary: dict) -> str:
    """The job's last line: eval_id and eval_ood before -> after, the verdict, the regressions
    ('!' marks one beyond tolerance)."""
    parts = [incomplete_text(summary["incomplete"])] if summary.get("incomplete") else []
    for name in TEMPLATE_SETS:
        s = summary["sets"].get(name)
        if s is None:
            if summary.get("incomplete"):
                parts.append(f"{name} not evaluated")
            continue
        if s["after"] is None:
            why = (summary.get("unscored") or {}).get(name)
            reason = (
                " (no episode scored: "
                + ", ".join(f"{n} {outcome}" for outcome, n in sorted(why.items()))
                + ")"
                if why
                else ""
            )
            parts.append(f"{name} {_pct(s['before']['rate'])} -> not evaluated{reason}")
            continue
        b, a = s["before"]["rate"], s["after"]["rate"]
        text = f"{name} {_pct(b)} -> {_pct(a)}"
        if name == "eval_id" and math.isfinite(a - b):
            factor = f"{a / b:.2f}x" if b > 0 else "inf x" if a > 0 else "1.00x"
            text += f" ({factor}, {100 * (a - b):+.1f} pts)"
        parts.append(text)
    verdict = summary["target"]
    if verdict.get("evaluated") is False:
        return " | ".join([*parts, "target not evaluated"])
    failed = [k for k, v in verdict.items() if k != "met" and not v]
    parts.append("target met" if verdict["met"] else "target missed: " + ", ".join(failed))
    regressed = [
        f"{r['template']} {_n(r['before'])}/{r['instances']} -> {_n(r['after'])}/{r['instances']}"
        + (" !" if r["beyond_tolerance"] else "")
        for r in summary["regressions"]
    ]
    parts.append("regressions: " + (", ".join(regressed) if regressed else "none"))
    return " | ".join(parts)


def incomplete_text(incomplete: dict) -> str:
    """`incomplete: learner killed (SIGKILL) during train, resume from step 10` (summary.json's
    `incomplete`, cli/main_job.py)."""
    step = incomplete.get("resume_from_step")
    resume = f"resume from step {step}" if step is not None else "no checkpoint"
    return (
        f"incomplete: {incomplete.get('service')} {incomplete.get('class')} during "
        f"{incomplete.get('phase')}, {resume}"
    )


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "n/a"


def _n(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"
