"""The push-at-sizes benchmark's logic on a CPU (benchmarks/gpu_push_sizes.py, which the H200 runs
at Qwen2.5-0.5B and 7B): both variants push a small Qwen2 through the learner's WeightSync into a
real engine (shm, float32), the engine serves each version, the streamed slots stay within the
bound and the results carry every number the table shows."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow


def test_the_sizes_section_runs_on_a_cpu_and_reports_both_variants_within_the_bound(tmp_path):
    out = tmp_path / "out"
    done = run_owned(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_gpu_weight_sync",
            *("--learner-device", "cpu", "--engine-device", "cpu", "--sections", "sizes"),
            *("--sizes-shapes", "qwen2-small", "--updates", "2", "--bucket-mib", "1"),
            *("--work-dir", str(tmp_path / "work"), "--out", str(out)),
        ],
        cwd=REPO,
        timeout_s=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shape = json.loads((out / "results.json").read_text())["sizes"]["qwen2-small"]
    stream, old = shape["stream"], shape["old"]
    assert old["buckets"] == 1 and stream["buckets"] > 2
    assert stream["dtype"] == old["dtype"] == "float32"  # a CPU engine is never cast down
    assert stream["served_value_ok"] and old["served_value_ok"]
    assert stream["total"]["n"] == old["total"]["n"] == 2
    assert shape["within_bound"] and 0 < stream["slots_peak_bytes"] <= shape["bound_bytes"]
    assert old["slots_peak_bytes"] >= shape["float32_bytes"]  # the whole model at once
    assert "fill" in stream["phases_median_ms"] and shape["stream_over_old"] > 0
    assert "Push at sizes" in (out / "results.md").read_text()
