"""The learner's labelled series exist (value 0) from start-up, before the first event."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.learner import metrics
from services.learner.group_assembler import DROP_REASONS


def test_every_drop_reason_has_a_zero_series_after_init():
    metrics.init_series(DROP_REASONS)
    values = {
        r: REGISTRY.get_sample_value("shellrl_trajectories_dropped_total", {"reason": r})
        for r in DROP_REASONS
    }
    assert set(DROP_REASONS) >= {"stale", "invalid", "duplicate", "late_member", "group_too_small"}
    assert all(v is not None and v >= 0 for v in values.values()), values
