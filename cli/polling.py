"""The command line's waits: poll a condition until it holds or an overall deadline passes.

    ready = poll_until(lambda: port_is_free(port), timeout_s=20, interval_s=0.5)
    if not ready: raise StackError(...)

One helper on tenacity (`Retrying`: wait_fixed between calls, stop_after_delay at the deadline),
so every wait of the CLI (ports, Redis, the learner's served policy, evaluations, a run, a
stopped stack, a dying service) has a deadline and no loop of its own re-implements one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import tenacity

T = TypeVar("T")


def poll_until(check: Callable[[], T], *, timeout_s: float, interval_s: float) -> T | None:
    """Call `check` every `interval_s` seconds until it returns a truthy value, and return that
    value; return None when `timeout_s` seconds passed first (the last call at or after the
    deadline). An exception of `check` propagates at once (a service that died ends the wait)."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout_s),
        wait=tenacity.wait_fixed(interval_s),
        retry=tenacity.retry_if_result(lambda result: not result),
        retry_error_callback=lambda _state: None,
    )
    return retrying(check)
