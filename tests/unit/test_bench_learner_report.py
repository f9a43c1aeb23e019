"""bench_learner's peak-memory rows: a baseline whose profile recorded no tensor memory (0 bytes:
the profiler's memory events depend on the torch build) gives "-", not ZeroDivisionError."""

from __future__ import annotations

from benchmarks.bench_learner import memory_cells

MIB = 2**20


def test_measured_rows_print_as_before():
    cells = memory_cells("per-sequence", 300 * MIB, 50 * MIB, 1.25, 600 * MIB, 200 * MIB)
    assert cells == ["per-sequence", "300", "0.50x", "50", "0.25x", "1.2"]


def test_a_baseline_without_tensor_memory_gives_no_ratio():
    cells = memory_cells("per-sequence", 300 * MIB, 50 * MIB, 1.0, 600 * MIB, 0)
    assert cells[3:5] == ["50", "-"]


def test_a_row_without_tensor_memory_gives_dashes():
    cells = memory_cells("glibc", 300 * MIB, 0, 1.0, 600 * MIB, 200 * MIB)
    assert cells[3:5] == ["-", "-"]


def test_a_baseline_of_zero_rss_gives_no_ratio():
    assert memory_cells("whole batch", 0, 0, 1.0, 0, 0)[1:3] == ["0", "-"]
