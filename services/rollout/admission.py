"""Staleness-bounded admission of GRPO groups (DESIGN.md section 5; AReaL's StalenessManager).

A new group is admitted only while

    groups_admitted < (base_version + max_staleness + 1) * groups_per_step

where `groups_admitted` counts every group ever admitted (persisted in Redis, so a restart does
not reset it) minus the groups given back (a group left with fewer than `MIN_USABLE` usable
trajectories never reaches a learner step, so it must not use up the learner's budget), and
`base_version` is
`shellrl:policy:version` (the learner's version, the truth; `shellrl:policy:updates` only wakes
us up).

Strict mode (`strict=True`, the default) uses `base_version = min(learner version, admission
version of the oldest group still in flight)`. Why: the learner trains B groups per step in
completion order, so its version when it trains a group g is at most floor(groups consumed before
and with g / B). With the plain rule a long-tail group admitted at version v can be overtaken by
an unbounded number of later groups and reach the learner far staler than max_staleness (then
it is dropped, which biases training against long episodes). With the strict rule every group
admitted while g is in flight has a position < (v + max_staleness + 1) * B, so g is trained at
version <= v + max_staleness: the bound holds for every trajectory, not only on average.
Without long tails both rules admit the same groups.

Usable members are counted as the learner counts them (`shellrl.contract.is_infra`: an INFRA
failure is removed from its group, never scored 0): once when the group is handed off
(`finish`), and again for each member the verifier then fails with INFRA (`member_lost`, from the
scored stream, stats.py). A group gives its admission back exactly once, when either count
leaves it below `MIN_USABLE` (docs/design-notes.md, "INFRA failures after the rollout").

Redis keys: shellrl:rollout:groups_admitted (int), shellrl:rollout:inflight (zset: member
"<replica>|<group_id>", score = learner version at admission), shellrl:rollout:group:{id} (hash:
usable, lost, given_back; kept `GROUP_ACCOUNTING_TTL_S`). Check-and-admit, finish and member_lost
are one Lua script each, so several gateway replicas share one bound.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.rollout import metrics as m
from services.rollout.policy_version import PolicyVersionWatcher
from shellrl.streams import POLICY_VERSION_KEY
from shellrl.streams.keys import ADMITTED_KEY, INFLIGHT_KEY, group_accounting_key

log = logging.getLogger(__name__)

MIN_USABLE = 2  # usable members a group needs to reach a learner step (1 has no baseline)
GROUP_ACCOUNTING_TTL_S = 24 * 3600  # how long a finished group's counts wait for verifier outcomes


# KEYS[1] policy version, KEYS[2] admitted counter, KEYS[3] in-flight zset
# ARGV[1] max_staleness, ARGV[2] groups_per_step, ARGV[3] strict 0/1, ARGV[4] member
_ADMIT = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local raw = redis.call('GET', KEYS[2])
if not raw then
  raw = tostring(v * tonumber(ARGV[2]))
  redis.call('SET', KEYS[2], raw)
end
local admitted = tonumber(raw)
local base = v
if ARGV[3] == '1' then
  local oldest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  if oldest[2] then base = math.min(base, tonumber(oldest[2])) end
end
local bound = (base + tonumber(ARGV[1]) + 1) * tonumber(ARGV[2])
if admitted < bound then
  redis.call('INCR', KEYS[2])
  redis.call('ZADD', KEYS[3], v, ARGV[4])
  return {1, admitted + 1, v, bound}
end
return {0, admitted, v, bound}
"""

# KEYS[1] admitted counter, KEYS[2] in-flight zset, KEYS[3] the group's accounting hash
# ARGV[1] member, ARGV[2] usable members at hand-off, ARGV[3] MIN_USABLE, ARGV[4] ttl (s)
# Returns {removed 0/1, given back 0/1}.
_FINISH = """
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 0 then return {0, 0} end
local lost = tonumber(redis.call('HGET', KEYS[3], 'lost') or '0')
redis.call('HSET', KEYS[3], 'usable', ARGV[2])
local give_back = 0
if tonumber(ARGV[2]) - lost < tonumber(ARGV[3]) then
  redis.call('DECR', KEYS[1])
  redis.call('HSET', KEYS[3], 'given_back', 1)
  give_back = 1
end
redis.call('EXPIRE', KEYS[3], ARGV[4])
return {1, give_back}
"""

# KEYS[1] admitted counter, KEYS[2] the group's accounting hash
# ARGV[1] trajectory id, ARGV[2] MIN_USABLE, ARGV[3] ttl (s)
# Returns 0 (already counted), 1 (counted) or 2 (counted, and the group's admission given back).
_MEMBER_LOST = """
if redis.call('HSETNX', KEYS[2], 'lost:' .. ARGV[1], 1) == 0 then return 0 end
local lost = redis.call('HINCRBY', KEYS[2], 'lost', 1)
redis.call('EXPIRE', KEYS[2], ARGV[3])
local usable = redis.call('HGET', KEYS[2], 'usable')
if usable and redis.call('HGET', KEYS[2], 'given_back') ~= '1'
    and tonumber(usable) - lost < tonumber(ARGV[2]) then
  redis.call('DECR', KEYS[1])
  redis.call('HSET', KEYS[2], 'given_back', 1)
  return 2
end
return 1
"""


@dataclass(frozen=True)
class Ticket:
    """An admitted group: `policy_version` is the learner version at admission."""

    group_id: str
    member: str
    policy_version: int
    admitted: int
    bound: int
    admitted_at: float


@dataclass(frozen=True)
class AdmissionState:
    learner_version: int
    groups_admitted: int
    bound: int
    oldest_in_flight_version: int | None
    groups_in_flight: int


class Admission:
    """Check-and-admit against the staleness bound; `admit` waits until a group fits."""

    def __init__(
        self,
        redis: aioredis.Redis,
        watcher: PolicyVersionWatcher,
        *,
        replica: str,
        max_staleness: int,
        groups_per_step: int,
        strict: bool = True,
        poll_s: float = 1.0,
    ) -> None:
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError("max_staleness >= 0 and groups_per_step >= 1")
        self.redis, self.watcher, self.replica = redis, watcher, replica
        self.max_staleness, self.groups_per_step, self.strict, self.poll_s = (
            max_staleness,
            groups_per_step,
            strict,
            poll_s,
        )
        self._admit = redis.register_script(_ADMIT)
        self._finish = redis.register_script(_FINISH)
        self._member_lost = redis.register_script(_MEMBER_LOST)

    async def try_admit(self, group_id: str) -> Ticket | None:
        member = f"{self.replica}|{group_id}"
        ok, admitted, version, bound = await self._admit(
            keys=[POLICY_VERSION_KEY, ADMITTED_KEY, INFLIGHT_KEY],
            args=[self.max_staleness, self.groups_per_step, "1" if self.strict else "0", member],
        )
        if not ok:
            return None
        m.GROUPS_ADMITTED.inc()
        return Ticket(group_id, member, int(version), int(admitted), int(bound), time.time())

    async def admit(self, group_id: str) -> Ticket:
        """Wait until the bound admits one more group, then admit it (time waited is a metric)."""
        start = time.monotonic()
        while True:
            ticket = await self.try_admit(group_id)
            if ticket is not None:
                waited = time.monotonic() - start
                if waited > 0.001:
                    m.ADMISSION_WAIT_SECONDS.labels("staleness").observe(waited)
                return ticket
            await self.watcher.wait(self.poll_s)

    async def finish(self, ticket: Ticket, *, usable: int) -> bool:
        """The group left flight with `usable` members (not INFRA, see `shellrl.contract.is_infra`).
        Its slot is given back when fewer than MIN_USABLE remain, counting the members the
        verifier already failed with INFRA (it will not reach a learner step). Returns whether
        it was given back."""
        _, given_back = await self._end(ticket.member, ticket.group_id, usable)
        self.watcher.wake()
        return bool(given_back)

    async def member_lost(self, group_id: str, trajectory_id: str) -> bool:
        """The verifier failed a member of `group_id` with INFRA after hand-off (idempotent by
        `trajectory_id`). Gives the group's slot back when this leaves it below MIN_USABLE
        usable members (once per group). Returns whether it was given back now."""
        result = await self._member_lost(
            keys=[ADMITTED_KEY, group_accounting_key(group_id)],
            args=[trajectory_id, MIN_USABLE, GROUP_ACCOUNTING_TTL_S],
        )
        if int(result) == 2:
            m.GROUPS_RELEASED.inc()
            self.watcher.wake()
        return int(result) == 2

    async def usable_members(self, group_id: str) -> int | None:
        """Usable members of a finished group as the gateway counts them now: at hand-off, minus
        the members the verifier failed with INFRA since (None: not finished, or forgotten)."""
        usable, lost = await self.redis.hmget(group_accounting_key(group_id), "usable", "lost")
        return None if usable is None else int(usable) - int(lost or 0)

    async def _end(self, member: str, group_id: str, usable: int) -> tuple[int, int]:
        removed, given_back = await self._finish(
            keys=[ADMITTED_KEY, INFLIGHT_KEY, group_accounting_key(group_id)],
            args=[member, usable, MIN_USABLE, GROUP_ACCOUNTING_TTL_S],
        )
        if given_back:
            m.GROUPS_RELEASED.inc()
        return int(removed), int(given_back)

    async def recover(self, replica: str | None = None) -> int:
        """At start-up: groups this replica had in flight died with it; give their slots back.
        With `replica`: the same for that (dead) replica. Returns how many groups."""
        replica = replica or self.replica
        prefix = f"{replica}|".encode()
        members = [
            mb for mb in await self.redis.zrange(INFLIGHT_KEY, 0, -1) if mb.startswith(prefix)
        ]
        for member in members:
            await self._end(member.decode(), member.decode()[len(prefix) :], 0)
        if members:
            log.warning(
                "gave back admission of groups in flight at the last shutdown",
                extra={"groups": len(members), "replica": replica},
            )
        return len(members)

    async def state(self) -> AdmissionState:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(POLICY_VERSION_KEY)
            pipe.get(ADMITTED_KEY)
            pipe.zrange(INFLIGHT_KEY, 0, 0, withscores=True)
            pipe.zcard(INFLIGHT_KEY)
            version, admitted, oldest, inflight = await pipe.execute()
        v = int(version) if version is not None else 0
        oldest_v = int(oldest[0][1]) if oldest else None
        base = min(v, oldest_v) if self.strict and oldest_v is not None else v
        return AdmissionState(
            v,
            int(admitted) if admitted is not None else v * self.groups_per_step,
            (base + self.max_staleness + 1) * self.groups_per_step,
            oldest_v,
            int(inflight),
        )
