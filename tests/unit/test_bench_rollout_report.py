"""bench_rollout's tables from degenerate measurements (a quick run's 0.5-1 s windows on a busy
2-core machine): no finished turn, pair or busy slot gives "-" (not measured), never a
ZeroDivisionError; measured values print as they did before."""

from __future__ import annotations

from benchmarks.bench_rollout import (
    NOT_MEASURED,
    OverheadResult,
    cell,
    overhead_cells,
    ratio,
    shipped_vs_before,
)


def result(**overrides) -> OverheadResult:
    values = dict(
        transport="aiohttp (as shipped)",
        concurrency=32,
        turns_per_s=779.0,
        pairs_per_s=1193.0,
        cpu_ms_per_turn=1.25,
        cpu_ms_per_pair=0.80,
        turn_latency_ms=3.5,
        pair_latency_ms=2.25,
    )
    return OverheadResult(**{**values, **overrides})


def test_measured_values_print_as_before():
    assert overhead_cells(result()) == [
        "aiohttp (as shipped)",
        "779",
        "1193",
        "0.65",
        "1.25",
        "0.80",
        "+0.45",
        "3.50",
        "2.25",
        "+1.25",
    ]
    line = shipped_vs_before(result(), result(turns_per_s=389.5, cpu_ms_per_turn=2.5))
    assert line == "shipped vs before: 2.00x turns/s, 2.00x less gateway CPU per turn"


def test_no_pair_in_the_window_gives_no_ratio():
    cells = overhead_cells(result(pairs_per_s=0.0))
    assert cells[2] == "0"
    assert cells[3] == NOT_MEASURED


def test_no_turn_in_the_single_episode_run_gives_no_latency_and_no_added_latency():
    cells = overhead_cells(result(turn_latency_ms=None))
    assert cells[7:] == [NOT_MEASURED, "2.25", NOT_MEASURED]
    cells = overhead_cells(result(pair_latency_ms=None))
    assert cells[7:] == ["3.50", NOT_MEASURED, NOT_MEASURED]


def test_the_comparison_line_without_turns_or_cpu_says_not_measured():
    line = shipped_vs_before(result(), result(turns_per_s=0.0, cpu_ms_per_turn=0.0))
    assert line == "shipped vs before: - turns/s, 0.00x less gateway CPU per turn"
    shipped = result(turns_per_s=0.0, cpu_ms_per_turn=0.0)
    line = shipped_vs_before(shipped, result())
    assert line == "shipped vs before: 0.00x turns/s, - less gateway CPU per turn"


def test_ratio_and_cell():
    assert ratio(1000, 0.0) is None  # latency of a run that finished nothing
    assert ratio(1000, 250.0) == 4.0
    assert ratio(None, 2.0) is None
    assert ratio(0.0, 2.0) == 0.0
    assert cell(None, ".2f", "x") == NOT_MEASURED
    assert cell(0.5, ".2f", "x") == "0.50x"  # the long-tail table's "vs sync" with a busy base
    assert cell(ratio(0.5, 0.0), ".2f", "x") == NOT_MEASURED  # a base with no busy slot
