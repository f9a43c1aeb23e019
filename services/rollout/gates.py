"""What a group waits for before the staleness bound (admission.py) is asked: free episode slots
(`Capacity`, held per group by `GroupSlots`) and an engine and sandbox that answer their health
probe after an INFRA failure (`InfraGate`); a sandbox host healthy enough is health_gate.py's
(`HealthGate`). Used by the rollout worker's main loop (worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.rollout import metrics as m

log = logging.getLogger(__name__)


class Capacity:
    """A counting semaphore that can take n slots at once (episodes in flight)."""

    def __init__(self, slots: int) -> None:
        self.slots, self.used = slots, 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        if n > self.slots:
            raise ValueError(
                f"a group of {n} episodes never fits {self.slots} slots (max_episodes_in_flight)"
            )
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.slots)
            self.used += n

    async def release(self, n: int = 1) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class InfraGate:
    """After an INFRA failure of the engine or sandbox, admission waits until its health probe answers."""

    def __init__(self, probes: dict, *, poll_s: float = 1.0) -> None:
        self.probes, self.poll_s = probes, poll_s  # name -> async () -> bool
        self.down: dict[str, float] = {}

    def mark_down(self, name: str) -> None:
        self.down.setdefault(name, time.monotonic())

    async def wait_up(self) -> None:
        for name in list(self.down):
            start = self.down[name]
            while not await self._probe(name):
                await asyncio.sleep(self.poll_s)
            self.down.pop(name, None)
            m.ADMISSION_WAIT_SECONDS.labels(f"{name}_down").observe(time.monotonic() - start)
            log.info("%s answers again; admission resumes", name)

    async def _probe(self, name: str) -> bool:
        try:
            return bool(await self.probes[name]())
        except Exception:  # a probe that cannot answer counts as down
            return False


class GroupSlots:
    """The capacity slots of one group, each freed exactly once."""

    def __init__(self, capacity: Capacity, n: int) -> None:
        self.capacity, self.held = capacity, n

    async def release_one(self) -> None:
        if self.held > 0:
            self.held -= 1
            await self.capacity.release(1)

    async def release_rest(self) -> None:
        if self.held > 0:
            n, self.held = self.held, 0
            await self.capacity.release(n)
