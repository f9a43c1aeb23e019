"""`shellrl status`'s table never shows 'None' or 'nan' (issue 34 item 5): a value not known yet
(a learner before its first step, a stream no group reads, staleness before any trajectory)
reads '-'; known values keep their format."""

from __future__ import annotations

import math

from rich.console import Console

from cli.stack_status import render, shown


def text_of(snap: dict) -> str:
    console = Console(record=True, width=200)
    console.print(render(snap))
    return console.export_text()


def test_values_not_known_yet_read_as_a_dash():
    snap = {
        "ready": {"learner": True, "rollout": True},
        "streams": {
            "_policy_version": None,
            "shellrl:dead": {"length": 0, "pending": None, "lag": None},
        },
        "learner": {"step": 0, "lr": None, "paused": True, "last_step": {"loss": None}},
        "rollout": {"admission": {}, "episodes_in_flight": 0},
        "staleness": {0.5: None, 0.9: None, 0.99: None},
    }
    text = text_of(snap)
    assert "None" not in text and "nan" not in text, text
    assert "reward -  success -  loss -" in text and "│ - / - / -" in text


def test_known_values_keep_their_format():
    assert shown(0.12345, ".3f") == "0.123" and shown(3) == "3" and shown(True) == "True"
    assert shown(None) == shown(math.nan, ".3f") == "-"
