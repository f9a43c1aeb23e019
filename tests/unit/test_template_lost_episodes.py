"""A lost template's episodes before and after the loss (issue 33 item 1,
cli/template_trajectories.lost_episodes): one task the point before solved and the losing point
failed, with both trajectory ids for `shellrl show`, on the recorded CPU run9
(docs/runs/main-job: file_size_bytes 2/3 -> 0/3) and on made-up views with a point between."""

from __future__ import annotations

import json
from pathlib import Path

from cli.run_summary import summarize
from cli.template_trajectories import lost_episodes, markdown_section

RUN9 = Path(__file__).resolve().parents[2] / "docs" / "runs" / "main-job"


def view(version: int, outcomes: dict[str, list[str]]) -> dict:
    """An evaluation view at `version` whose task t had the episodes outcomes[t]."""
    results = [
        {
            "task_id": task_id,
            "episode": k,
            "trajectory_id": f"ev{version}-{task_id}-{k}",
            "outcome": outcome,
            "reward": 1.0 if outcome == "success" else 0.0,
            "policy_versions": [version],
        }
        for task_id, episodes in outcomes.items()
        for k, outcome in enumerate(episodes)
    ]
    return {"results": results, "policy_versions_seen": [version]}


A, B = "gen-count_lines-00000000000a", "gen-count_lines-00000000000b"


def test_run9s_lost_template_names_a_solved_and_a_failed_episode_of_one_task():
    evaluations = json.loads((RUN9 / "evaluations.json").read_text())
    before, after = evaluations["before"], evaluations["after"]
    ood = summarize(before, after, None, {})["templates"]["eval_ood"]["file_size_bytes"]
    ep = ood["lost_episodes"]
    assert (ep["before_step"], ep["after_step"]) == (0, 28)
    results = {r["trajectory_id"]: r for v in (before, after) for r in v["eval_ood"]["results"]}
    assert results[ep["before"]]["outcome"] == "success"
    assert results[ep["after"]]["outcome"] != "success"
    assert results[ep["before"]]["task_id"] == results[ep["after"]]["task_id"] == ep["task_id"]


def test_the_pair_comes_from_the_point_before_the_loss_and_the_losing_point():
    points = [
        {"eval_id": view(0, {A: ["success"], B: ["wrong"]})},
        {"eval_id": view(5, {A: ["success"], B: ["success"]})},
        {"eval_id": view(10, {A: ["wrong"], B: ["success"]})},
    ]
    summary = summarize(points[0], points[2], None, {}, during=[points[1]])
    entry = summary["templates"]["eval_id"]["count_lines"]
    assert entry["lost_at_step"] is None  # 1 -> 2 -> 1: never below the base policy's 1
    points[2] = {"eval_id": view(10, {A: ["wrong"], B: ["wrong"]})}
    summary = summarize(points[0], points[2], None, {}, during=[points[1]])
    entry = summary["templates"]["eval_id"]["count_lines"]
    assert entry["lost_at_step"] == 10
    assert entry["lost_episodes"] == {
        "task_id": A,  # both dropped by one success: the first in result order
        "before_step": 5,
        "before": f"ev5-{A}-0",
        "after_step": 10,
        "after": f"ev10-{A}-0",
    }
    text = "\n".join(markdown_section(summary["templates"]))
    assert f"`shellrl show ev5-{A}-0`" in text and f"`shellrl show ev10-{A}-0`" in text


def test_sampled_episodes_pick_the_task_whose_successes_dropped_most_and_a_wrong_answer():
    before = view(0, {A: ["success", "wrong"], B: ["success", "success"]})
    after = view(3, {A: ["success", "wrong"], B: ["infra_engine", "wrong"]})
    ep = lost_episodes("count_lines", (0, before), (3, after), None)
    assert ep["task_id"] == B and ep["after"] == f"ev3-{B}-1"  # the wrong answer, not the infra


def test_no_pair_without_trajectory_ids():
    before, after = view(0, {A: ["success"]}), view(1, {A: ["wrong"]})
    for r in before["results"]:
        del r["trajectory_id"]
    assert lost_episodes("count_lines", (0, before), (1, after), None) is None
