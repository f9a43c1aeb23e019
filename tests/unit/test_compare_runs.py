"""`shellrl report --compare`: runs of the main job aggregated (cli/compare.py), through the real
command line, from report directories as the job writes them."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from cli.run_summary import summarize
from tests.unit.test_eval_stats import view

TASKS = [f"gen-count_lines-{i:012x}" for i in range(5)] + [
    f"gen-cat_file-{i:012x}" for i in range(5, 10)
]


def run_dir(tmp_path, name: str, seed: int, solved_after: int, ood_after: str = "s") -> str:
    """A report directory with summary.json: 2 of 10 eval_id tasks solved before (count_lines),
    `solved_after` after (count_lines first, then cat_file)."""
    before = {
        "eval_id": view({t: "s" if i < 2 else "w" for i, t in enumerate(TASKS)}),
        "eval_ood": view({"gen-last_line-00000000000f": "s"}),
    }
    after = {
        "eval_id": view({t: "s" if i < solved_after else "w" for i, t in enumerate(TASKS)}),
        "eval_ood": view({"gen-last_line-00000000000f": ood_after}),
    }
    out = tmp_path / name / "report"
    out.mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps(summarize(before, after, None, {"seed": seed})))
    return str(tmp_path / name)


def test_three_runs_give_the_fraction_meeting_the_target_and_t_intervals(tmp_path, capsys):
    dirs = [
        run_dir(tmp_path, "seed0", 0, solved_after=6),
        run_dir(tmp_path, "seed1", 1, solved_after=7),
        run_dir(tmp_path, "seed2", 2, solved_after=3, ood_after="w"),
    ]
    out = tmp_path / "compare"
    assert main(["report", "--compare", *dirs, "--out", str(out)]) == 0
    agg = json.loads((out / "compare.json").read_text())
    assert agg["target"]["runs_met"] == 2 and agg["target"]["fraction_met"] == pytest.approx(2 / 3)
    assert agg["target"]["fraction_per_check"]["eval_ood_does_not_fall"] == pytest.approx(2 / 3)
    after = agg["sets"]["eval_id"]["after"]
    assert after["values"] == [0.6, 0.7, 0.3] and after["mean"] == pytest.approx(16 / 30)
    assert after["low"] < after["mean"] < after["high"]  # Student-t over the three runs
    cat = agg["templates"]["eval_id"]["cat_file"]
    assert cat["after"] == [1.0, 2.0, 0.0] and cat["lost_any"] == 0
    assert (out / "compare.png").stat().st_size > 10_000 and "Student-t" in agg["estimator"]
    assert "Target met by 2 of 3 runs" in (out / "compare.md").read_text()
    printed = capsys.readouterr().out
    assert "target met by 2 of 3 runs" in printed and "seed2" in printed


def test_a_report_without_summary_is_summarized_from_its_evaluations(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    evaluations = {
        "before": {"eval_id": view({TASKS[0]: "w", TASKS[5]: "s"})},
        "after": {"eval_id": view({TASKS[0]: "s", TASKS[5]: "s"})},
    }
    (old / "evaluations.json").write_text(json.dumps(evaluations))
    assert main(["report", "--compare", str(old), "--out", str(tmp_path / "c")]) == 0
    agg = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert set(agg["templates"]["eval_id"]) == {"count_lines", "cat_file"}  # parsed from the ids


def test_a_directory_without_a_report_fails_with_one_line(tmp_path, capsys):
    assert main(["report", "--compare", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert "no summary.json or evaluations.json" in capsys.readouterr().err
