"""KL to the initial policy on the eval episodes, per eval template (issue 33 item 1), for the
main job's evaluations during training and after (`--eval-kl`): what moved on the templates a
policy lost, trained on or not (eval_ood never is).

For every episode of an evaluation (eval_id and eval_ood) it reads the transcript from the
gateway (`GET /v1/trajectories/{id}`: prompt token ids, then each segment's token ids; an ACTION
segment's tokens count as sampled), sends the sequences to the paused learner (`POST /v1/kl`,
services/learner/kl_probe.py: current policy and frozen reference, temperature 1), and sums the
k3 KL per template. A transcript the gateway no longer keeps is left out (counted in `missing`).
Result: {set: {template: {"kl": mean per sampled token, "tokens", "episodes"}}}, with "step" (the
evaluation's policy version) and "missing" alongside the sets.
"""

from __future__ import annotations

import httpx

from cli.eval_stats import template_of
from cli.template_trajectories import eval_step

SETS = ("eval_id", "eval_ood")
CHUNK = 32  # sequences per POST /v1/kl


def sequence(transcript: dict) -> tuple[dict, int]:
    """(POST /v1/kl sequence, sampled tokens) of a transcript view."""
    response, mask = [], []
    for turn in transcript.get("turns", []):
        for seg in turn["segments"]:
            ids = seg.get("token_ids") or []
            response += ids
            mask += [int(seg.get("kind") == "action")] * len(ids)
    body = {"prompt_ids": transcript["prompt"]["token_ids"], "response_ids": response}
    return body | {"loss_mask": mask}, sum(mask)


def eval_kl(
    gateway: httpx.Client, learner: httpx.Client, views: dict[str, dict], tasks_by_id: dict
) -> dict:
    """The KL per template of one evaluation's episodes (module docstring). gateway, learner:
    clients with base URLs and the stack's auth headers; the learner must be paused."""
    episodes, missing = [], 0  # (set, template, sequence)
    for name in SETS:
        for r in (views.get(name) or {}).get("results", []):
            if not r.get("trajectory_id"):
                continue
            got = gateway.get(f"/v1/trajectories/{r['trajectory_id']}", timeout=30)
            if got.status_code == 404:
                missing += 1
                continue
            got.raise_for_status()
            body, tokens = sequence(got.json())
            if tokens and body["prompt_ids"]:
                episodes.append((name, template_of(r["task_id"], tasks_by_id), body))
    rows = []
    for lo in range(0, len(episodes), CHUNK):
        chunk = [e[2] for e in episodes[lo : lo + CHUNK]]
        r = learner.post("/v1/kl", json={"sequences": chunk}, timeout=900)
        r.raise_for_status()
        rows += r.json()["sequences"]
    out: dict = {"step": eval_step(views), "missing": missing}
    for (name, template, _), row in zip(episodes, rows):
        acc = out.setdefault(name, {}).setdefault(
            template, {"kl_sum": 0.0, "tokens": 0, "episodes": 0}
        )
        acc["kl_sum"] += row["kl_sum"]
        acc["tokens"] += row["tokens"]
        acc["episodes"] += 1
    for name in SETS:
        for acc in (out.get(name) or {}).values():
            acc["kl"] = acc.pop("kl_sum") / acc["tokens"] if acc["tokens"] else 0.0
    return out


def markdown_section(points: list[dict]) -> list[str]:
    """report.md's table: per eval template, the KL on its eval episodes at each evaluation."""
    if not points:
        return []
    lines = [
        "### KL to the initial policy on the eval episodes (k3, nats per sampled token)",
        "",
        "| set: template | KL by step (step: KL) |",
        "|---|---|",
    ]
    keys = sorted({(n, t) for p in points for n in SETS for t in p.get(n) or {}})
    for name, template in keys:
        shown = ", ".join(
            f"{p['step']}: {p[name][template]['kl']:.3g}"
            for p in points
            if template in (p.get(name) or {})
        )
        lines.append(f"| {name}: {template} | {shown} |")
    missing = sum(p.get("missing", 0) for p in points)
    note = f" {missing} episodes' transcripts were gone and are left out." if missing else ""
    return [*lines, "", f"From the learner's POST /v1/kl while paused.{note}", ""]
