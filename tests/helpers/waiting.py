"""Polling until a condition holds, for tests that wait on real processes (sync and asyncio)."""

from __future__ import annotations

import asyncio
import inspect
import time


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition", poll_s: float = 0.2):
    """Call `predicate()` every `poll_s` seconds until it returns something truthy; return that.
    Raises AssertionError naming `what` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


async def wait_until_async(
    predicate, timeout_s: float = 30.0, what: str = "condition", poll_s: float = 0.1
):
    """`wait_until` in a coroutine: `predicate()` may return a value or an awaitable."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
