"""The control-plane benchmark's learner (benchmarks/control_plane_learner.py) runs the real
LearnerWorker over a FakeWeightSync: the fake must answer every call the worker makes on its weight
sync. It lacked publish_pending (which a paused worker calls), so the benchmark's drain stack died
in every full run while its quick form (no drain) passed (issue 37)."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.control_plane_learner import FakeWeightSync

WORKER = Path(__file__).resolve().parents[2] / "services" / "learner" / "worker.py"


def test_the_fake_weight_sync_has_every_method_the_worker_calls():
    called = set(re.findall(r"self\.sync\.(\w+)\(", WORKER.read_text()))
    assert {"push", "reconcile", "publish_pending"} <= called  # the reading itself still works
    assert not {name for name in called if not callable(getattr(FakeWeightSync, name, None))}
