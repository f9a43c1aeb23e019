"""report.md's KL to the initial policy per training template over steps (cli/template_kl.py),
from the learner's step records (steps.json `kl_by_template`, issue 33 item 1)."""

from __future__ import annotations

import json

from cli.report import write_report
from cli.template_kl import kl_series, markdown_section, thinned


def record(step: int, by_template: dict[str, float] | None) -> dict:
    out = {"step": step, "version": step, "trajectories": 2, "seconds": 1.0}
    if by_template is not None:
        out["kl_by_template"] = {
            t: {"kl": kl, "tokens": 10, "trajectories": 2} for t, kl in by_template.items()
        }
    return out


STEPS = [
    record(1, {"count_lines": 0.0, "disk_usage": 0.001}),
    record(2, {"count_lines": 0.02}),
    record(3, None),  # a record from before the field: left out
    record(4, {"count_lines": 0.01, "disk_usage": 0.05}),
]


def test_series_lists_each_template_at_the_steps_that_trained_on_it():
    assert kl_series(STEPS) == {
        "count_lines": [(1, 0.0), (2, 0.02), (4, 0.01)],
        "disk_usage": [(1, 0.001), (4, 0.05)],
    }


def test_thinning_keeps_the_first_and_last_and_at_most_n():
    points = list(range(37))
    kept = thinned(points, 10)
    assert len(kept) == 10 and kept[0] == 0 and kept[-1] == 36
    assert thinned(points[:5], 10) == points[:5]


def test_section_names_each_template_its_kl_by_step_and_largest():
    text = "\n".join(markdown_section(STEPS))
    assert "| count_lines | 3 | 1: 0, 2: 0.02, 4: 0.01 | 0.02 (2) |" in text
    assert "| disk_usage | 2 | 1: 0.001, 4: 0.05 | 0.05 (4) |" in text
    assert "Not recorded" in "\n".join(markdown_section([record(1, None)]))


def test_report_md_and_steps_json_carry_the_kl_per_template(tmp_path):
    path = write_report(
        tmp_path,
        config={},
        before={},
        after={},
        steps=STEPS,
        snapshots=[],
        learner_metrics="",
        rollout_metrics="",
        train_s=10,
        total_s=20,
        tasks_by_id={},
    )
    assert "KL to the initial policy per training template" in path.read_text()
    assert "| disk_usage | 2 |" in path.read_text()
    assert "![kl_by_template.png](kl_by_template.png)" in path.read_text()
    assert (tmp_path / "kl_by_template.png").stat().st_size > 0
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert steps[3]["kl_by_template"]["disk_usage"]["kl"] == 0.05
