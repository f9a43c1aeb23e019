"""Every eval template over training (issue 33 item 1, cli/template_trajectories.py), on recorded
runs: the GPU job's three seeds of 2026-12-05 (docs/runs/gpu-2026-12-05-graphs/s0-s2, summary.json
written before trajectories existed) and the CPU run9 (docs/runs/main-job, evaluations.json only)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from cli.compare import aggregate, load_run, markdown, write_compare
from cli.run_summary import summarize
from cli.template_trajectories import eval_step, lost_at_step, markdown_section

RUNS = Path(__file__).resolve().parents[2] / "docs" / "runs"
SEEDS = [RUNS / "gpu-2026-12-05-graphs" / f"s{i}" for i in range(3)]
RUN9 = RUNS / "main-job"


def at_version(views: dict, version: int) -> dict:
    """The recorded evaluation `views` as if they had run on policy `version`."""
    out = copy.deepcopy(views)
    for view in out.values():
        view["policy_version"], view["policy_versions_seen"] = version, [version]
    return out


def test_a_recorded_summary_gets_its_two_points_and_the_step_it_lost_at():
    s2 = load_run(SEEDS[2])["templates"]
    assert s2["eval_ood"]["file_size_bytes"]["trajectory"] == [
        {"step": 0, "solved": 2.0},
        {"step": 37, "solved": 0.0},
    ]
    assert s2["eval_ood"]["file_size_bytes"]["lost_at_step"] == 37
    assert s2["eval_id"]["count_lines"]["lost_at_step"] is None  # 4/10 -> 10/10


def test_run9_evaluations_place_points_at_their_policy_versions():
    evaluations = json.loads((RUN9 / "evaluations.json").read_text())
    assert eval_step(evaluations["before"]) == 0 and eval_step(evaluations["after"]) == 28
    summary = summarize(evaluations["before"], evaluations["after"], None, {})
    ood = summary["templates"]["eval_ood"]["file_size_bytes"]
    assert [p["step"] for p in ood["trajectory"]] == [0, 28] and ood["lost_at_step"] == 28
    cat_file = summary["templates"]["eval_id"]["cat_file"]  # learned: 0/9 -> 8/9
    assert cat_file["trajectory"][-1]["solved"] == 8.0 and cat_file["lost_at_step"] is None


def test_an_evaluation_during_training_dates_the_loss_to_its_step():
    evaluations = json.loads((RUN9 / "evaluations.json").read_text())
    before, after = evaluations["before"], evaluations["after"]
    during = [at_version(before, 7), at_version(after, 14)]
    summary = summarize(before, after, None, {}, during=during)
    ood = summary["templates"]["eval_ood"]["file_size_bytes"]
    assert [(p["step"], p["solved"]) for p in ood["trajectory"]] == [
        (0, 2.0),
        (7, 2.0),
        (14, 0.0),
        (28, 0.0),
    ]
    assert ood["lost_at_step"] == 14
    assert "| eval_ood: file_size_bytes | 0: 2/3, 7: 2/3, 14: 0/3, 28: 0/3 | 14 |" in "\n".join(
        markdown_section(summary["templates"])
    )


def test_a_template_that_drops_below_its_base_after_a_gain_counts_as_lost():
    path = [{"step": 0, "solved": 3.0}, {"step": 10, "solved": 5.0}, {"step": 20, "solved": 2.5}]
    assert lost_at_step(path) == 20 and lost_at_step(path[:2]) is None and lost_at_step([]) is None


def test_compare_over_three_seeds_gives_each_run_s_loss_step_or_never(tmp_path):
    agg = aggregate([load_run(d) for d in SEEDS])
    rows = agg["template_trajectories"]
    assert rows["eval_id"]["count_lines"]["lost_at_step"] == [37, None, None]
    assert rows["eval_ood"]["file_size_bytes"]["lost_at_step"] == [None, None, 37]
    assert rows["eval_ood"]["file_size_bytes"]["runs_lost"] == 1
    assert len(rows["eval_id"]) == 7 and len(rows["eval_ood"]) == 10  # every eval template
    text = markdown(agg)
    assert "| eval_id: count_lines | 10 | 1 of 3 | 37, never, never |" in text
    write_compare(SEEDS, tmp_path)
    written = json.loads((tmp_path / "compare.json").read_text())
    assert written["template_trajectories"]["eval_id"]["word_count"]["lost_at_step"] == [
        None,
        None,
        None,
    ]
