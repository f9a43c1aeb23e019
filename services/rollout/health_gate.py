"""The sandbox-health gate of the rollout worker (worker.py), beside gates.py's: `HealthGate` slows
the admission of new groups while the sandbox host's terminal health score (services/sandbox/
host/health.py, read from its /readyz by `sandbox_health_score`) is below its threshold.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from services.rollout import metrics as m

log = logging.getLogger(__name__)


def sandbox_health_score(ready: dict) -> float | None:
    """The terminal health score in a sandbox /readyz body (`health.score`, services/sandbox/
    health.py), or the mean over a fleet's members (`members`: url -> /readyz body) that report
    one; None when none does (an older sandbox: never slows admission)."""
    if isinstance(ready.get("members"), dict):
        scores = [sandbox_health_score(m) for m in ready["members"].values() if isinstance(m, dict)]
        known = [s for s in scores if s is not None]
        return sum(known) / len(known) if known else None
    score = (ready.get("health") or {}).get("score")
    return float(score) if isinstance(score, int | float) else None


class HealthGate:
    """Slows the admission of new groups while the sandbox's terminal health score is below
    `threshold`: each new group then waits `delay_s` first (admission goes on, at most one group
    per delay_s). The write-up behind the score (issue 21) saw success rates below 30% whenever
    it fell under 0.45, hence the default threshold: episodes started on a starved host fail for
    the host's sake, not the policy's. The score is read through `read_ready` (the sandbox's
    /readyz body) at most every `refresh_s`; a failed read keeps the last score.
    threshold 0: never slows."""

    def __init__(
        self,
        read_ready: Callable[[], Awaitable[dict]],
        *,
        threshold: float = 0.45,
        delay_s: float = 2.0,
        refresh_s: float = 5.0,
    ) -> None:
        if not 0 <= threshold <= 1 or delay_s < 0 or refresh_s < 0:
            raise ValueError("threshold in [0, 1], delay_s >= 0 and refresh_s >= 0")
        self.read_ready, self.threshold = read_ready, threshold
        self.delay_s, self.refresh_s = delay_s, refresh_s
        self.score: float | None = None
        self.slowed = False
        self.groups_delayed = 0
        self._read_at = -math.inf

    async def current_score(self) -> float | None:
        """The score, read again when older than refresh_s."""
        if time.monotonic() - self._read_at >= self.refresh_s:
            self._read_at = time.monotonic()
            try:
                self.score = sandbox_health_score(await self.read_ready())
            except Exception as exc:  # noqa: BLE001 (the InfraGate handles a sandbox that is down)
                log.debug("reading the sandbox health score failed: %r", exc)
            if self.score is not None:
                m.SANDBOX_HEALTH_SCORE.set(self.score)
        return self.score

    async def wait(self) -> None:
        """Before a new group: sleep delay_s when the score is below the threshold."""
        if not self.threshold:
            return
        score = await self.current_score()
        slowed = score is not None and score < self.threshold
        if slowed != self.slowed:
            log.warning(
                "sandbox health score %s %.3f: admission %s",
                "below" if slowed else "back at",
                score if score is not None else math.nan,
                f"slowed ({self.delay_s:g} s per new group)" if slowed else "at full speed",
            )
        self.slowed = slowed
        if slowed:
            self.groups_delayed += 1
            m.GROUPS_DELAYED_UNHEALTHY.inc()
            m.ADMISSION_WAIT_SECONDS.labels("sandbox_unhealthy").observe(self.delay_s)
            await asyncio.sleep(self.delay_s)

    async def read_status(self) -> dict:
        """For the rollout /v1/status: the score (read again when older than refresh_s), whether
        it is below the threshold now, and whether the last new group was slowed."""
        await self.current_score()
        return self.status()

    def status(self) -> dict:
        score = self.score
        return {
            "score": None if score is None else round(score, 4),
            "threshold": self.threshold,
            "below_threshold": score is not None and score < self.threshold,
            "slowed": self.slowed,
            "delay_s": self.delay_s,
            "groups_delayed": self.groups_delayed,
        }
