"""Pass-rate steering of the training pool: fewer groups of templates the policy always or never
solves, so more of the rollout budget goes where a group can carry a gradient.

A group of G samples has reward variance with probability 1 - p^G - (1 - p)^G for a template of
pass rate p: 0.08 at p = 1 %, 0.5 at p = 8 %, near 1 between 10 % and 90 % (BENCHMARKS.md, "Main
job"). The gateway keeps, per template (`template_key`: the task's generator template, else
"task:<task_id>"), the outcomes of its last `window_episodes` scored training episodes (success
= reward >= 1, the plain outcome), recorded by the stats consumer (stats.py). When a task comes
up in the epoch order (task_pool.py), `keep` decides:
  * fewer than `window_episodes` outcomes recorded: keep (not known yet);
  * recent pass rate within [low, high]: keep;
  * outside (0 or 100 % "for long": over the whole window): keep with probability
    `keep_fraction`, else the task is passed over for this epoch. The draw is a hash of (seed,
    task id, epoch), so one seed makes the same choices for the same rates; `keep_fraction` > 0
    keeps exploring a template the policy may start (or stop) solving.

Redis: shellrl:rollout:template:{key}:outcomes (list of "1"/"0", newest first, capped at the
window), shared by every gateway replica.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import redis.asyncio as aioredis

from shellrl.contract import Task
from shellrl.streams.keys import template_outcomes_key


@dataclass(frozen=True)
class SteeringConfig:
    """window_episodes: outcomes a template's pass rate is taken over; low, high: the band kept
    in full (fractions); keep_fraction: share of out-of-band tasks still run; seed: of the draws."""

    window_episodes: int = 32
    low: float = 0.1
    high: float = 0.9
    keep_fraction: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.window_episodes < 1 or not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError("window_episodes >= 1 and 0 <= low <= high <= 1")
        if not 0.0 <= self.keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be in [0, 1]; got {self.keep_fraction}")


def template_key(task: Task) -> str:
    """The unit pass rates are kept per: the generator template, else the task itself."""
    return task.template or f"task:{task.task_id}"


class Steering:
    """Online per-template pass rates (`record`, `pass_rate`) and the admission rule (`keep`)."""

    def __init__(self, redis: aioredis.Redis, config: SteeringConfig) -> None:
        self.redis, self.config = redis, config

    async def record(self, task: Task, success: bool) -> None:
        """One scored training episode of `task` (call once per trajectory)."""
        await self.record_many([(task, success)])

    async def record_many(self, outcomes: list[tuple[Task, bool]]) -> None:
        """`record` for several scored training episodes (task, success) in one round trip."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for task, success in outcomes:
                key = template_outcomes_key(template_key(task))
                pipe.lpush(key, "1" if success else "0")
                pipe.ltrim(key, 0, self.config.window_episodes - 1)
            await pipe.execute()

    async def pass_rate(self, task: Task) -> float | None:
        """Success rate of the template's last `window_episodes` episodes; None while fewer."""
        key = template_outcomes_key(template_key(task))
        outcomes = await self.redis.lrange(key, 0, self.config.window_episodes - 1)
        if len(outcomes) < self.config.window_episodes:
            return None
        return sum(o == b"1" for o in outcomes) / len(outcomes)

    async def keep(self, task: Task, epoch: int) -> bool:
        """Whether `task` runs now (see the module docstring)."""
        rate = await self.pass_rate(task)
        if rate is None or self.config.low <= rate <= self.config.high:
            return True
        return draw(self.config.seed, task.task_id, epoch) < self.config.keep_fraction


def draw(seed: int, task_id: str, epoch: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, task id, epoch)."""
    digest = hashlib.sha256(f"{seed}|{task_id}|{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
