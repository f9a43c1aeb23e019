"""`shellrl experiment` (issue 21, item 4) without a stack: what a point's ledger and episodes
sum up to, the table's rows, the report's files and figures, the experiments' points, and the
command's refusals of bad options."""

from __future__ import annotations

import json
import math

import pytest

from cli.experiments import workload
from cli.experiments.measure import (
    EpisodeRecord,
    PointResult,
    StepRecord,
    cumulative_tokens,
    steps_from_ledger,
    summarize,
)
from cli.experiments.report import COLUMNS, markdown_table, rich_table, table_rows, write_report
from cli.experiments.runner import samples_by_label
from cli.main import main

T0 = 1_700_000_000.0


def point(name="p", *, steps=(), episodes=(), slots=4, window_s=10.0, wait_s=0.0, dropped=None):
    return PointResult(
        name=name,
        settings={"rollout": {"SHELLRL_MAX_STALENESS": "1"}},
        slots=slots,
        window_s=window_s,
        steps=tuple(steps),
        episodes=tuple(episodes),
        dropped=dropped or {},
        environment_wait_s=wait_s,
    )


def step(wall_s, tokens=100, trajectories=4, staleness=0.5, staleness_max=1.0, reward=0.0):
    return StepRecord(wall_s, tokens, trajectories, reward, staleness, staleness_max)


def test_ledger_steps_skip_events_keep_the_last_record_of_a_step_and_start_at_t0():
    records = [
        {"step": 1, "finished_at": T0 + 2, "tokens": 10, "trajectories": 2, "reward_mean": 0.0},
        {"event": "resume", "step": 1},
        {"step": 1, "finished_at": T0 + 3, "tokens": 12, "trajectories": 2, "reward_mean": 0.5},
        {"step": 2, "finished_at": T0 + 5, "trajectories": 0, "reward_mean": 0.0},
    ]
    steps = steps_from_ledger(records, T0)
    assert [(s.wall_s, s.tokens, s.reward_mean) for s in steps] == [(3.0, 12, 0.5), (5.0, 0, 0.0)]
    assert math.isnan(steps[1].staleness_mean)  # a step that trained nothing has no staleness
    assert cumulative_tokens(steps) == [12, 12]


def test_summary_counts_only_what_ended_within_the_window_and_clips_busy_time_to_it():
    p = point(
        steps=[step(4, tokens=100), step(9, tokens=60), step(12, tokens=1000)],
        episodes=[
            EpisodeRecord(0.0, 5.0),
            EpisodeRecord(2.0, 8.0, "FAILURE_INFRA_SANDBOX"),
            EpisodeRecord(6.0, 14.0),  # still running at the window's end: 4 s of it count
        ],
        slots=2,
        window_s=10.0,
        wait_s=1.0,
    )
    s = summarize(p)
    assert s["episodes"] == 2 and s["episodes_per_min"] == pytest.approx(12.0)
    assert s["learner_steps"] == 2 and s["trained_tokens"] == 160
    assert s["tokens_per_s"] == pytest.approx(16.0)
    assert s["utilisation"] == pytest.approx((5 + 6 + 4 - 1.0) / (2 * 10))
    assert s["episode_s_mean"] == pytest.approx(5.5)
    assert s["failures"] == 1


def test_staleness_is_the_mean_over_trained_trajectories_and_the_max_over_steps():
    p = point(
        steps=[
            step(1, trajectories=2, staleness=0.0, staleness_max=0),
            step(2, trajectories=6, staleness=2.0, staleness_max=3),
            step(3, trajectories=0, staleness=math.nan, staleness_max=math.nan),
        ],
        dropped={"stale": 4.0},
    )
    s = summarize(p)
    assert s["staleness_mean"] == pytest.approx(1.5)
    assert s["staleness_max"] == 3 and s["dropped_stale"] == 4.0


def test_table_has_one_row_per_point_in_order_with_throughput_relative_to_the_first():
    results = [
        point("1 environment", steps=[step(5, tokens=50)], episodes=[EpisodeRecord(0, 1)]),
        point(
            "4 environments",
            steps=[step(5, tokens=200)],
            episodes=[EpisodeRecord(0, 1), EpisodeRecord(0, 2), EpisodeRecord(1, 3)],
        ),
        point("idle"),  # nothing trained, nothing finished: n/a rather than a made-up number
    ]
    rows = table_rows(results)
    assert [r[0] for r in rows] == ["1 environment", "4 environments", "idle"]
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert rows[1][COLUMNS.index("vs first: episodes/min, tokens/s")] == "3.00x, 4.00x"
    assert rows[2][COLUMNS.index("staleness mean / max")] == "n/a / n/a"
    assert rows[2][COLUMNS.index("mean episode s")] == "n/a"
    assert len(markdown_table(results)) == 2 + 3
    exp = workload.build("concurrency", scale=0.1, quick=True)
    assert rich_table(exp, results).row_count == 3


def test_report_writes_markdown_results_and_both_figures(tmp_path):
    exp = workload.build("long-tail", scale=0.05, quick=True, window_s=10.0)
    results = [
        point(
            p.name,
            steps=[step(2, staleness=0.0), step(6, staleness=1.0), step(9, trajectories=0)],
            episodes=[EpisodeRecord(0, 1), EpisodeRecord(0.5, 4.5)],
        )
        for p in exp.points
    ]
    report = write_report(tmp_path, exp, results, {"command": "shellrl experiment long-tail"})
    text = report.read_text()
    for name in ("long-tail_vs_wall_clock.png", "long-tail_vs_trained_tokens.png"):
        assert (tmp_path / name).stat().st_size > 5000  # a drawn figure, not an empty file
        assert f"![{name}]({name})" in text
    assert all(f"| {p.name} |" in text for p in exp.points)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [p["name"] for p in saved["points"]] == [p.name for p in exp.points]
    assert saved["points"][0]["summary"]["learner_steps"] == 3


def test_experiments_have_the_points_of_the_issue_and_scale_their_delays():
    full = {name: workload.build(name, scale=0.1, quick=False) for name in workload.NAMES}
    assert [p.slots for p in full["concurrency"].points] == [1, 4, 8, 16]
    assert [
        p.service_env["sandbox"]["SHELLRL_MAX_SESSIONS"] for p in full["concurrency"].points
    ] == [
        "1",
        "4",
        "8",
        "16",
    ]
    tail = full["long-tail"]
    assert [p.service_env["rollout"]["SHELLRL_MAX_STALENESS"] for p in tail.points] == [
        "0",
        "2",
        "2",
    ]
    setups = sorted(t["setup"] for t in tail.tasks)
    assert setups == ["sleep 1.000"] * 7 + ["sleep 8.000"]  # 7 x 10 s and 1 x 80 s, x 0.1
    ks = [p.service_env["learner"]["SHELLRL_MAX_STALENESS"] for p in full["staleness"].points]
    assert ks == ["0", "1", "2", "4"]
    quick = workload.build("staleness", scale=0.1, quick=True, ks=(0, 2))
    assert [p.name for p in quick.points] == ["sync (k=0)", "async k=2"]
    with pytest.raises(ValueError, match="levels"):
        workload.build("concurrency", scale=0.1, quick=True, levels=(0, 4))


def test_samples_are_read_by_label_from_a_metrics_text():
    text = (
        "# TYPE shellrl_trajectories_dropped counter\n"
        'shellrl_trajectories_dropped_total{reason="stale"} 3.0\n'
        'shellrl_trajectories_dropped_total{reason="duplicate"} 1.0\n'
    )
    assert samples_by_label(text, "shellrl_trajectories_dropped_total", "reason") == {
        "stale": 3.0,
        "duplicate": 1.0,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["experiment", "concurrency", "--scale", "0"],
        ["experiment", "concurrency", "--levels", "0", "4"],
        ["experiment", "staleness", "--ks", "-1"],
    ],
)
def test_bad_options_fail_in_one_line_before_any_stack_starts(argv, capsys, tmp_path):
    assert main([*argv, "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shellrl experiment: error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "experiments").exists()
