"""Exec slots: at most `capacity` commands run at once across all sessions, handed out fairly.

A free slot goes to the waiting session that has held slots the least lately (its slot-seconds,
halved every `half_life_s`), ties in arrival order; plain FIFO would queue a session's short
command behind every other session's waiting long command. A session waits for one slot at a
time (its commands run in order), so a session that used less than the others waits at most
until the next slot frees, however many long commands are queued. Slots are not preemptive: a
running command keeps its slot until it ends. How long a command waited is reported with its
result (`queue_ms`), apart from how long it ran (`duration_ms`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field


def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class _Waiter:
    key: str
    seq: int
    granted: asyncio.Future = field(default_factory=_future)


class FairSlots:
    """`capacity` slots; `hold(key)` waits for one (see module doc). Event-loop only, not
    thread-safe. `clock` (seconds) is injectable for tests."""

    def __init__(
        self, capacity: int, half_life_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.half_life_s, self.clock = capacity, half_life_s, clock
        self.running = 0
        self._waiting: list[_Waiter] = []  # at most one per session: a linear scan is cheap
        self._usage: dict[str, tuple[float, float]] = {}  # key -> (slot-seconds, as of when)
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def usage_s(self, key: str, now: float | None = None) -> float:
        """Slot-seconds `key` held lately (decayed to `now`)."""
        value, at = self._usage.get(key, (0.0, 0.0))
        now = self.clock() if now is None else now
        return value * 0.5 ** (max(0.0, now - at) / self.half_life_s) if value else 0.0

    def forget(self, key: str) -> None:
        """Drop what is known about `key` (its session was deleted)."""
        self._usage.pop(key, None)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[float]:
        """Hold one slot for `key` (a session id) while the block runs; yields the seconds it
        waited for the slot. Cancellation while waiting gives up the place (or the slot)."""
        start = self.clock()
        if self.running < self.capacity and not self._waiting:
            self.running += 1
        else:
            waiter = _Waiter(key, next(self._seq))
            self._waiting.append(waiter)
            try:
                await waiter.granted
            except asyncio.CancelledError:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                elif not waiter.granted.cancelled():  # granted, then cancelled: pass it on
                    self._release()
                raise
        granted = self.clock()
        try:
            yield granted - start
        finally:
            now = self.clock()
            self._usage[key] = (self.usage_s(key, now) + (now - granted), now)
            self._release()

    def _release(self) -> None:
        self.running -= 1
        now = self.clock()
        while self.running < self.capacity and self._waiting:
            waiter = min(self._waiting, key=lambda w: (self.usage_s(w.key, now), w.seq))
            self._waiting.remove(waiter)
            if waiter.granted.done():  # its task was cancelled
                continue
            waiter.granted.set_result(None)
            self.running += 1
