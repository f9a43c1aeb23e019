"""cli.pass_rates: per-template rates from an evaluation view, the curriculum band, and the
probability that a GRPO group has reward variance."""

import json
from pathlib import Path

import pytest

from cli import pass_rates as pr


def test_rates_from_view_counts_successes_per_template_and_skips_unscored_episodes():
    view = {
        "results": [
            {"task_id": "a1", "outcome": "success", "reward": 1.0},
            {"task_id": "a1", "outcome": "wrong", "reward": 0.0},
            {"task_id": "a2", "outcome": "infra", "reward": None},  # INFRA: not a task failure
            {"task_id": "b1", "outcome": "wrong", "reward": 0.0},
        ]
    }
    rates = pr.rates_from_view(view, {"a1": "alpha", "a2": "alpha", "b1": "beta"})
    assert [(r.template, r.successes, r.episodes) for r in rates] == [
        ("alpha", 1, 2),
        ("beta", 0, 1),
    ]
    assert rates[0].rate == 0.5 and rates[1].rate == 0.0


@pytest.mark.parametrize(
    "p, expected", [(0.0, 0.0), (1.0, 0.0), (0.5, 1 - 2 * 0.5**8), (0.1, 1 - 0.1**8 - 0.9**8)]
)
def test_trainable_group_probability(p, expected):
    rate = pr.TemplateRate("t", round(p * 1000), 1000)
    assert rate.trainable_group_probability(8) == pytest.approx(expected)


def test_select_templates_keeps_the_band_inclusive():
    rates = [
        pr.TemplateRate("never", 0, 12),
        pr.TemplateRate("low", 1, 20),
        pr.TemplateRate("mid", 3, 12),
        pr.TemplateRate("edge", 3, 4),
        pr.TemplateRate("always", 12, 12),
    ]
    assert pr.select_templates(rates, 0.05, 0.75) == ["low", "mid", "edge"]


def test_write_then_load_round_trips(tmp_path: Path):
    rates = [pr.TemplateRate("a", 1, 12), pr.TemplateRate("b", 0, 12)]
    pr.write(tmp_path / "r.json", rates, {"temperature": 0.7})
    assert pr.load(tmp_path / "r.json") == rates
    assert json.loads((tmp_path / "r.json").read_text())["temperature"] == 0.7


def test_the_committed_measurements_load():
    for name in ("pass_rates_T1.0.json", "pass_rates_T0.7.json"):
        rates = pr.load(Path(__file__).resolve().parents[2] / "docs" / "runs" / "pass-rates" / name)
        assert rates and all(0 <= r.successes <= r.episodes for r in rates)
