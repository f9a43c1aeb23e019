"""`shellrl experiment` end to end (issue 21, item 4): the quickest form of the concurrency sweep
(one point, 2 environments, a 4 s window) as the user runs it, in its own process: it starts the
real stack (tiny model, CPU), runs episodes whose setup sleeps 1 s in the real sandbox, prints the
table and writes the report with both figures. Most of its time is the stack's start."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.owned_processes import run_owned

REPO = Path(__file__).resolve().parents[2]


def test_quickest_concurrency_sweep_prints_its_table_and_writes_report_and_figures(tmp_path):
    state = tmp_path / "state"
    argv = ["experiment", "concurrency", "--levels", "2", "--window-s", "4", "--quick"]
    done = run_owned(
        [sys.executable, "-m", "cli.main", *argv, "--state-dir", str(state)],
        cwd=REPO,
        env={**os.environ, "COLUMNS": "250"},
        capture_output=True,
        text=True,
        timeout_s=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = state / "experiments" / "concurrency"
    for name in ("concurrency_vs_wall_clock.png", "concurrency_vs_trained_tokens.png"):
        assert (out / name).stat().st_size > 5000, name
    table_lines = [line for line in done.stdout.splitlines() if "│" in line]
    assert len(table_lines) == 1 and "2 environments" in table_lines[0], done.stdout
    results = json.loads((out / "results.json").read_text())
    assert [p["name"] for p in results["points"]] == ["2 environments"]
    summary = results["points"][0]["summary"]
    assert summary["episodes"] >= 1 and summary["failures"] == 0  # the stack did real episodes
    assert "| 2 environments |" in (out / "report.md").read_text()
    assert not (out / "stack" / "stack.json").exists()  # the stack was stopped
