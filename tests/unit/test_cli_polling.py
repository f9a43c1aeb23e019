"""cli/polling.py, the one wait of the command line (issue 34 item 7): it returns the first truthy
value, gives up at its deadline, and lets an exception of the check (a dead service) through at
once."""

from __future__ import annotations

import time

import pytest

from cli.polling import poll_until


def test_returns_the_first_truthy_value():
    calls = []

    def third() -> str | None:
        calls.append(1)
        return "ready" if len(calls) == 3 else None

    assert poll_until(third, timeout_s=5, interval_s=0.01) == "ready" and len(calls) == 3


def test_gives_up_at_the_deadline_with_none():
    t0 = time.monotonic()
    assert poll_until(lambda: False, timeout_s=0.3, interval_s=0.05) is None
    assert 0.3 <= time.monotonic() - t0 < 1.5


def test_an_exception_of_the_check_ends_the_wait_at_once():
    calls = []

    def dies() -> bool:
        calls.append(1)
        raise RuntimeError("engine exited")

    with pytest.raises(RuntimeError, match="engine exited"):
        poll_until(dies, timeout_s=5, interval_s=0.01)
    assert len(calls) == 1
