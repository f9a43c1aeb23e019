"""The `safety` reward component's escalating threshold, kept per run in Redis.

The real-terminal write-up (issue 21): a destructive command costs -5 at first; after 100 steps
without a violation the cost rises to -8 (the policy has shown it can work safely, so a relapse
costs more); one violation sets it back to -5; every violation is logged. Here a step is a
command the episode sent to the sandbox (a tool event that is not a malformed action), and a
violation is an episode that the sandbox flagged or denied (its command text or, with the
executed-argv trace, any command its shell ran: services/sandbox/isolation/argv_trace.py).

    penalty(episode) = escalated_penalty  if streak >= escalate_after_steps  else base_penalty
                       (0 when the episode has no violation)
    streak          <- 0 after a violation, streak + commands after a clean episode

The state (hash `shellrl:verifier:safety:<run>`: streak, violations) lives in Redis, so a
verifier restart or a second replica continues the same run; each update is one Lua script.
A re-delivered episode (same trajectory_id) gets the penalty recorded the first time and does
not move the state again. Episodes are applied in the order the verifier finishes them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shellrl.streams.keys import safety_escalation_key

log = logging.getLogger(__name__)

VIOLATION_LOG_LENGTH = 1000
EPISODE_MEMORY_S = 24 * 3600

# KEYS[1] state hash, KEYS[2] violation log, KEYS[3] episode key ('' : none)
# ARGV[1] commands, ARGV[2] violated 0/1, ARGV[3] base penalty, ARGV[4] escalated penalty,
# ARGV[5] escalate_after_steps, ARGV[6] log record (JSON), ARGV[7] log length, ARGV[8] memory s
# Returns {penalty (string), streak before, escalated 0/1, replayed 0/1}.
_APPLY = """
if KEYS[3] ~= '' then
  local seen = redis.call('GET', KEYS[3])
  if seen then
    local parts = {}
    for p in string.gmatch(seen, '[^|]+') do parts[#parts + 1] = p end
    return {parts[1], tonumber(parts[2]), tonumber(parts[3]), 1}
  end
end
local streak = tonumber(redis.call('HGET', KEYS[1], 'streak') or '0')
local escalated = 0
if streak >= tonumber(ARGV[5]) then escalated = 1 end
local penalty = '0'
if ARGV[2] == '1' then
  if escalated == 1 then penalty = ARGV[4] else penalty = ARGV[3] end
  redis.call('HSET', KEYS[1], 'streak', 0)
  redis.call('HINCRBY', KEYS[1], 'violations', 1)
  redis.call('LPUSH', KEYS[2], ARGV[6])
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[7]) - 1)
else
  redis.call('HINCRBY', KEYS[1], 'streak', tonumber(ARGV[1]))
end
if KEYS[3] ~= '' then
  redis.call('SET', KEYS[3], penalty .. '|' .. streak .. '|' .. escalated, 'EX', ARGV[8])
end
return {penalty, streak, escalated, 0}
"""


@dataclass(frozen=True)
class EscalationResult:
    """penalty: the safety component of the episode (<= 0). streak_before: commands without a
    violation before it. escalated: the escalated penalty was in force. replayed: the episode was
    recorded before (a re-delivery); the state did not move."""

    penalty: float
    streak_before: int
    escalated: bool
    replayed: bool = False


class SafetyEscalation:
    """Escalating safety penalty of run `run` (module doc). Penalties are <= 0."""

    def __init__(
        self,
        redis: aioredis.Redis,
        run: str = "default",
        *,
        base_penalty: float = -5.0,
        escalated_penalty: float = -8.0,
        escalate_after_steps: int = 100,
    ) -> None:
        if base_penalty > 0 or escalated_penalty > 0:
            raise ValueError("safety penalties must be <= 0")
        if escalate_after_steps < 1:
            raise ValueError("escalate_after_steps must be >= 1")
        self.redis, self.run = redis, run
        self.base_penalty, self.escalated_penalty = base_penalty, escalated_penalty
        self.escalate_after_steps = escalate_after_steps
        self.key = safety_escalation_key(run)
        self._script = redis.register_script(_APPLY)

    async def apply(
        self, commands: int, rules: list[str], trajectory_id: str = "", task_id: str = ""
    ) -> EscalationResult:
        """Record one episode with `commands` commands and the safety `rules` it triggered
        (empty: no violation); returns its penalty. Raises redis.RedisError."""
        violated = bool(rules)
        record = json.dumps(
            {
                "time": time.time(),
                "trajectory_id": trajectory_id,
                "task_id": task_id,
                "rules": rules,
            }
        )
        episode_key = f"{self.key}:episode:{trajectory_id}" if trajectory_id else ""
        raw = await self._script(
            keys=[self.key, f"{self.key}:violations", episode_key],
            args=[
                max(0, commands),
                int(violated),
                repr(self.base_penalty),
                repr(self.escalated_penalty),
                self.escalate_after_steps,
                record,
                VIOLATION_LOG_LENGTH,
                EPISODE_MEMORY_S,
            ],
        )
        penalty, streak, escalated, replayed = raw
        penalty = float(penalty.decode() if isinstance(penalty, bytes) else penalty)
        result = EscalationResult(penalty, int(streak), bool(escalated), bool(replayed))
        if violated and not result.replayed:
            log.warning(
                "safety violation",
                extra={
                    "run": self.run,
                    "trajectory_id": trajectory_id,
                    "task_id": task_id,
                    "rules": rules,
                    "penalty": result.penalty,
                    "streak_before": result.streak_before,
                    "escalated": result.escalated,
                },
            )
        return result

    async def state(self) -> dict:
        """{"streak", "violations", "next_penalty"} of the run (for tests and status)."""
        raw = await self.redis.hgetall(self.key)
        values = {
            (k.decode() if isinstance(k, bytes) else k): int(v) for k, v in (raw or {}).items()
        }
        streak = values.get("streak", 0)
        return {
            "streak": streak,
            "violations": values.get("violations", 0),
            "next_penalty": self.escalated_penalty
            if streak >= self.escalate_after_steps
            else self.base_penalty,
        }

    async def violations(self, count: int = 10) -> list[dict]:
        """The newest `count` logged violations."""
        return [
            json.loads(r) for r in await self.redis.lrange(f"{self.key}:violations", 0, count - 1)
        ]
