"""The run report (issue 22, item 8): steps that trained nothing are gaps, not 0 tokens/s; every
eval bar carries n and a 95% Wilson interval; the wall-clock axis comes from timestamps, not the
sum of step times; rollout throughput is drawn next to the learner's."""

from __future__ import annotations

import math

import pytest

from cli import report_plots as rp
from cli.report import write_report

T0 = 1_700_000_000.0


def step(
    n: int,
    *,
    finished_s: float,
    outcomes: dict,
    trajectories: int = 0,
    tokens_per_second: float = 0.0,
    seconds: float = 5.0,
    reward: float = 0.25,
) -> dict:
    return {
        "step": n,
        "version": n,
        "trajectory_ids": [],
        "outcomes": outcomes,
        "trajectories": trajectories,
        "tokens_per_second": tokens_per_second,
        "seconds": seconds,
        "reward_mean": reward,
        "success_rate": reward,
        "rss_bytes": 2**30,
        "finished_at": T0 + finished_s,
    }


STEPS = [
    step(
        1,
        finished_s=60,
        outcomes={"trained": 2, "zero_variance": 2},
        trajectories=16,
        tokens_per_second=900,
    ),
    step(
        2, finished_s=70, outcomes={"zero_variance": 4}, seconds=0.01
    ),  # nothing trained, rewards seen
    step(3, finished_s=400, outcomes={"dropped": 4}, seconds=0.01),  # nothing scored at all
    step(
        4,
        finished_s=460,
        outcomes={"trained": 1, "zero_variance": 3},
        trajectories=8,
        tokens_per_second=700,
    ),
]


def snapshot(t: float, step_n: int, published: int, tokens: float | None) -> dict:
    return {
        "time": T0 + t,
        "learner": {"step": step_n},
        "rollout": {"trajectories_published": published},
        "engine_generation_tokens": tokens,
    }


SNAPSHOTS = [
    snapshot(0, 0, 0, 0.0),
    snapshot(30, 0, 60, 1200.0),
    snapshot(62, 1, 120, 2400.0),
    snapshot(402, 3, 700, None),
    snapshot(462, 4, 820, 20000.0),
]


def test_steps_that_trained_nothing_are_gaps_not_zero_tokens_per_second():
    tokens = rp.learner_tokens_per_s(STEPS)
    assert tokens[0] == 900 and tokens[3] == 700
    assert math.isnan(tokens[1]) and math.isnan(tokens[2])
    reward = rp.batch_metric(STEPS, "reward_mean")
    assert reward[1] == 0.25  # zero-variance groups still have a reward
    assert math.isnan(reward[2])  # every group dropped: no reward to draw


def test_wall_clock_axis_comes_from_step_timestamps_not_the_sum_of_step_times():
    minutes, label = rp.wall_clock_min(STEPS, SNAPSHOTS, T0)
    assert minutes == pytest.approx([1.0, 70 / 60, 400 / 60, 460 / 60])
    assert label == "training wall-clock (min)"
    assert minutes[-1] > 10 * sum(s["seconds"] for s in STEPS) / 60  # the sum would say ~10 s


def test_old_ledgers_without_timestamps_use_the_snapshots_then_say_it_is_a_sum():
    old = [{k: v for k, v in s.items() if k != "finished_at"} for s in STEPS]
    minutes, label = rp.wall_clock_min(old, SNAPSHOTS, T0)
    assert (
        minutes == pytest.approx([62 / 60, 402 / 60, 402 / 60, 462 / 60]) and "snapshots" in label
    )
    minutes, label = rp.wall_clock_min(old, [], None)
    assert minutes[-1] == pytest.approx(10.02 / 60) and "sum of step times" in label


def test_rollout_throughput_from_consecutive_snapshots():
    minutes, episodes, tokens = rp.rollout_throughput(SNAPSHOTS, T0)
    assert minutes == pytest.approx([0.5, 62 / 60, 402 / 60, 462 / 60])
    assert episodes == pytest.approx([2.0, 60 / 32, 580 / 340, 2.0])
    assert tokens[:2] == pytest.approx([40.0, 1200 / 32])
    assert math.isnan(tokens[2]) and math.isnan(tokens[3])  # the engine did not answer at 402 s


@pytest.mark.parametrize(
    "successes, n, low, high",
    [(5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (1, 4, 0.0456, 0.6994)],
)
def test_wilson_interval_matches_published_values(successes, n, low, high):
    lo, hi = rp.wilson_interval(successes, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_eval_bar_carries_n_and_its_interval():
    rate, n, lo, hi = rp.eval_bar({"success_rate": 0.5, "episodes_scored": 4})
    assert (
        (rate, n) == (0.5, 4)
        and lo == pytest.approx(0.15, abs=0.01)
        and hi == pytest.approx(0.85, abs=0.01)
    )
    assert (
        rp.eval_bar({"success_rate": 0.5, "episodes_scored": 64})[3]
        - rp.eval_bar({"success_rate": 0.5, "episodes_scored": 64})[2]
        < hi - lo
    )  # 64 episodes: a narrower bar than 4
    assert math.isnan(rp.eval_bar(None)[0]) and rp.eval_bar(None)[1] == 0


def test_write_report_draws_every_plot_and_states_n_and_intervals(tmp_path):
    before = {
        "eval_id": {"success_rate": 0.1875, "episodes_scored": 64, "results": []},
        "seeds": {"success_rate": 0.25, "episodes_scored": 4, "results": []},
    }
    after = {
        "eval_id": {"success_rate": 0.4375, "episodes_scored": 64, "results": []},
        "seeds": {"success_rate": 0.5, "episodes_scored": 4, "results": []},
    }
    metrics = (
        "# TYPE shellrl_trajectory_staleness histogram\n"
        'shellrl_trajectory_staleness_bucket{le="0.0"} 10\n'
        'shellrl_trajectory_staleness_bucket{le="1.0"} 24\n'
        'shellrl_trajectory_staleness_bucket{le="+Inf"} 24\nshellrl_trajectory_staleness_count 24\n'
        "shellrl_trajectory_staleness_sum 14\n"
    )
    path = write_report(
        tmp_path,
        config={"steps": 4},
        before=before,
        after=after,
        steps=[{"event": "resume", "step": 0}, *STEPS],
        snapshots=SNAPSHOTS,
        learner_metrics=metrics,
        rollout_metrics="",
        train_s=460,
        total_s=900,
        tasks_by_id={},
        train_started_at=T0,
    )
    text = path.read_text()
    for png in (
        "reward_success_vs_step.png",
        "reward_success_vs_time.png",
        "throughput.png",
        "staleness.png",
        "eval_before_after.png",
    ):
        assert (tmp_path / png).stat().st_size > 5000 and f"]({png})" in text
    assert "| eval_id | 64 | 18.8% [11.1, 30.0] | 43.8% [32.3, 55.9] | +25.0 pts |" in text
    assert "| seeds | 4 | 25.0% [4.6, 69.9] | 50.0% [15.0, 85.0] | +25.0 pts |" in text
    assert "trained-batch reward by step ('-': no scored trajectory): 0.25 0.25 - 0.25" in text


def test_the_report_names_a_few_successes_and_failures_per_template_for_shellrl_show(tmp_path):
    from cli.report import transcript_examples
    from shellrl.contract import task_from_json

    def task(template: str):
        return task_from_json(
            {
                "instruction": "x",
                "template": template,
                "check": {"type": "answer_equals", "expected": "1"},
            }
        )

    tasks = {"a": task("count_lines"), "b": task("find_file")}
    outcomes = ["success", "wrong", "infra_sandbox", "success", "success", "wrong", "wrong"]
    results = [
        {"task_id": "a" if i < 5 else "b", "trajectory_id": f"tr-{i}", "outcome": o}
        for i, o in enumerate(outcomes)
    ]
    view = {"success_rate": 0.5, "episodes_scored": 6, "results": results}
    assert transcript_examples(view, tasks) == {
        "count_lines": {"success": ["tr-0", "tr-3"], "failure": ["tr-1", "tr-2"]},
        "find_file": {"success": [], "failure": ["tr-5", "tr-6"]},
    }
    path = write_report(
        tmp_path,
        config={},
        before={"eval_id": view},
        after={"eval_id": view},
        steps=[],
        snapshots=[],
        learner_metrics="",
        rollout_metrics="",
        train_s=0,
        total_s=1,
        tasks_by_id=tasks,
    )
    text = path.read_text()
    assert "### Transcripts (after training): `shellrl show <trajectory_id>`" in text
    assert "| eval_id: find_file | `tr-5` (failure), `tr-6` (failure) |" in text
