"""Task cancellation that survives libraries which swallow a cancel.

On Python 3.11, `asyncio.wait_for` returns the inner result and drops a cancel that arrives in
the same loop iteration as the inner future's completion (cpython gh-86296, fixed in 3.12 where
`wait_for` is built on `asyncio.timeout`). redis-py wraps every command write in `wait_for`
when a socket timeout is set (`redis.asyncio.connection.Connection.send_packed_command`), so a
stream consumer cancelled at the wrong moment keeps looping forever and `await task` never
returns: measured here on Python 3.11.7 and redis-py 8.1, between 1 in 5 and 1 in 60 cancels
of an XREADGROUP loop at random moments, and 13 of 40 runs of tests/service/rollout/test_scheduler.py
on a busy machine (see `tests/service/test_cancel.py`). Every shutdown path in shellrl cancels through
`cancel_and_wait`, which repeats the cancel until the task has really finished. Repeating is not
enough on its own: a consumer that writes back to back sits in the window most of the time, and in
CI four cancels a second apart all missed; `shellrl.streams.CancelSafeConnection` (every redis:// client
made by `shellrl.streams.connect` or the rollout gateway's pool) writes under `asyncio.timeout`
instead, which drops no cancel. Other `asyncio.wait_for` calls (e.g. in the rollout scheduler and
admission) keep the 3.11 behaviour, so `cancel_and_wait` stays the way every shutdown path cancels.
"""

from __future__ import annotations

import asyncio
import time

RECANCEL_INTERVAL_S = 1.0  # long enough for a task's own clean-up after the first cancel


async def cancel_and_wait(*tasks: asyncio.Future | None, timeout_s: float | None = None) -> bool:
    """Cancel `tasks` (None entries are skipped) and wait until every one is done, cancelling
    again every RECANCEL_INTERVAL_S while one is still running (a swallowed cancel).

    Returns True when all are done, False when `timeout_s` (seconds) passed first. Never raises
    the tasks' exceptions; a task's own exception stays retrievable with `task.exception()`.
    """
    pending = {t for t in tasks if t is not None and not t.done()}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        wait_s = RECANCEL_INTERVAL_S
        if deadline is not None:
            wait_s = min(wait_s, deadline - time.monotonic())
            if wait_s <= 0:
                return False
        _, pending = await asyncio.wait(pending, timeout=wait_s)
    for task in tasks:  # mark exceptions retrieved: no "exception was never retrieved" noise
        if task is not None and task.done() and not task.cancelled():
            task.exception()
    return True
