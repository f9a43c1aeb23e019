"""Estimators of the main job's evaluations (cli/eval_stats.py) and the run's verdict
(cli/run_summary.py), on evaluation views shaped as GET /v1/evaluations/{id} returns them."""

from __future__ import annotations

import math

import pytest

from cli import eval_stats as es
from cli.run_summary import regressions, summarize, summary_line, target


def view(outcomes: dict[str, str]) -> dict:
    """An evaluation view: {task_id: outcomes, one letter per episode: s success, w wrong,
    i infra failure (not scored)}."""
    results = []
    for task_id, letters in outcomes.items():
        for k, letter in enumerate(letters):
            outcome = {"s": "success", "w": "wrong", "i": "infra_engine"}[letter]
            reward = {"s": 1.0, "w": 0.0, "i": None}[letter]
            results.append({"task_id": task_id, "episode": k, "outcome": outcome, "reward": reward})
    scored = [r for r in results if r["reward"] is not None]
    return {
        "results": results,
        "episodes_scored": len(scored),
        "success_rate": sum(r["outcome"] == "success" for r in scored) / len(scored),
    }


def test_one_greedy_episode_per_task_is_the_success_rate_with_a_wilson_interval_over_tasks():
    v = view({f"gen-count_lines-{i:012x}": "s" if i < 3 else "w" for i in range(10)})
    score = es.set_score(v)
    assert score.rate == pytest.approx(0.3) and score.samples_per_task == 1
    assert (score.low, score.high) == pytest.approx(es.wilson_interval(3, 10))
    assert score.estimator == "wilson over tasks"


def test_several_samples_per_task_average_pass_rates_and_bootstrap_over_tasks():
    v = view({"a": "ssss", "b": "swww", "c": "wwww", "d": "ssww", "e": "iwww"})
    score = es.set_score(v)
    assert score.rate == pytest.approx((1 + 0.25 + 0 + 0.5 + 0) / 5)  # e: 0/3 scored
    assert score.samples_per_task == 4 and score.episodes == 19 and score.tasks == 5
    assert score.low < score.rate < score.high and score.estimator == "bootstrap over tasks"
    assert (score.low, score.high) == (es.set_score(v).low, es.set_score(v).high)  # fixed seed
    same = es.set_score(view({f"t{i}": "wwww" for i in range(10)}))  # no spread: Wilson stands in
    assert same.rate == 0 and (same.low, same.high) == pytest.approx(es.wilson_interval(0, 10))


def test_template_scores_count_solved_instances_as_the_sum_of_pass_rates():
    v = view({"gen-cat_file-00000000000a": "ss", "eval-gen-cat_file-00000000000b": "sw"})
    v["results"].append({"task_id": "seed-x", "outcome": "wrong", "reward": 0.0})
    assert es.template_scores(v) == {
        "cat_file": {"instances": 2, "solved": 1.5},
        "seed-x": {"instances": 1, "solved": 0.0},
    }


def test_t_interval_matches_a_hand_computed_one():
    mean, low, high = es.t_interval([0.4, 0.5, 0.6])
    half = 4.303 * 0.1 / math.sqrt(3)
    assert (mean, low, high) == pytest.approx((0.5, 0.5 - half, 0.5 + half))
    assert math.isnan(es.t_interval([0.3])[1]) and es.t_quantile_975(200) == pytest.approx(
        1.972, abs=1e-3
    )


def test_target_needs_double_plus_ten_points_no_template_loss_beyond_one_and_ood_held():
    sets = {
        "eval_id": {"before": {"rate": 0.2}, "after": {"rate": 0.45}},
        "eval_ood": {"before": {"rate": 0.1}, "after": {"rate": 0.1}},
    }
    templates = {"eval_id": {"count_lines": {"instances": 10, "before": 4.0, "after": 3.0}}}
    found = regressions(templates)
    assert found[0]["beyond_tolerance"] is False and target(sets, found)["met"]
    templates["eval_id"]["count_lines"]["after"] = 2.0
    assert target(sets, regressions(templates))["no_template_loses_more_than_1"] is False
    sets["eval_id"]["after"]["rate"] = 0.35  # +15 points but not double
    assert target(sets, [])["eval_id_doubles"] is False
    sets["eval_id"]["after"]["rate"] = 0.45
    sets["eval_ood"]["after"]["rate"] = 0.05
    assert target(sets, [])["eval_ood_does_not_fall"] is False


def test_summary_line_names_each_template_that_lost_instances():
    before = {
        "eval_id": view({"gen-count_lines-000000000001": "s", "gen-word_count-000000000002": "w"}),
        "eval_ood": view({"gen-last_line-000000000003": "w"}),
    }
    after = {
        "eval_id": view({"gen-count_lines-000000000001": "w", "gen-word_count-000000000002": "s"}),
        "eval_ood": view({"gen-last_line-000000000003": "w"}),
    }
    summary = summarize(before, after, None, {"seed": 3})
    line = summary_line(summary)
    assert summary["seed"] == 3 and not summary["target"]["met"]
    assert "eval_id 50.0% -> 50.0% (1.00x, +0.0 pts)" in line
    assert "regressions: count_lines 1/1 -> 0/1" in line and " !" not in line


def test_an_after_evaluation_that_scored_nothing_is_not_evaluated_and_loses_no_template():
    """big4-s1 (H100, 2026-12-06): the engine stopped answering in training, every episode of the
    last evaluation was infra_engine, and the line read "count_lines 4/10 -> 0/10 !": templates
    counted as lost that were never evaluated. Such a set is not evaluated, and neither is the
    target; `shellrl report --compare` refuses the run as it refuses an incomplete one."""
    before = {
        "eval_id": view({"gen-count_lines-000000000001": "s", "gen-word_count-000000000002": "w"}),
        "eval_ood": view({"gen-last_line-000000000003": "s"}),
    }
    infra = [
        {"task_id": t, "episode": 0, "outcome": "infra_engine", "reward": None}
        for t in ("gen-count_lines-000000000001", "gen-word_count-000000000002")
    ]
    after = {
        "eval_id": {"results": infra, "episodes_scored": 0, "success_rate": None},
        "eval_ood": view({"gen-last_line-000000000003": "s"}),
    }
    summary = summarize(before, after, None, {"seed": 1})
    assert summary["target"] == {"met": False, "evaluated": False}
    assert summary["regressions"] == []
    assert summary["unscored"] == {"eval_id": {"infra_engine": 2}}
    assert summary["sets"]["eval_id"]["after"] is None
    assert summary["templates"]["eval_id"]["count_lines"]["after"] is None
    line = summary_line(summary)
    assert "eval_id 50.0% -> not evaluated (no episode scored: 2 infra_engine)" in line
    assert "target not evaluated" in line and "regressions" not in line
    # one scored episode is an evaluation: the loss then counts as before
    after["eval_id"] = view(
        {"gen-count_lines-000000000001": "w", "gen-word_count-000000000002": "i"}
    )
    summary = summarize(before, after, None, {"seed": 1})
    assert "unscored" not in summary and "evaluated" not in summary["target"]
    assert [r["template"] for r in summary["regressions"]] == ["count_lines"]


def test_compare_refuses_a_run_that_was_not_evaluated(tmp_path):
    from cli.compare import load_run

    before = {"eval_id": view({"gen-count_lines-000000000001": "s"})}
    infra = [{"task_id": "gen-count_lines-000000000001", "episode": 0, "outcome": "infra_engine"}]
    after = {"eval_id": {"results": infra, "episodes_scored": 0, "success_rate": None}}
    import json

    (tmp_path / "evaluations.json").write_text(json.dumps({"before": before, "after": after}))
    with pytest.raises(ValueError, match="not evaluated after training"):
        load_run(tmp_path)
