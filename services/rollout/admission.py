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

Dynamic sampling (`dynamic_sampling=True`; DAPO, shellrl/rl/dynamic_sampling.py): a group whose
usable members all scored the same reward key carries no gradient, so it gives its admission
back too, once every usable member was scored (`member_scored`, from the scored stream, stats.py;
checked again at `finish` and `member_lost`, whichever comes last), and another group is admitted
in its place under the same bound. The learner then counts only groups with reward variance, so
each of its steps trains `groups_per_step` groups that carry a gradient.

Redis keys: shellrl:rollout:groups_admitted (int), shellrl:rollout:inflight (zset: member
"<replica>|<group_id>", score = learner version at admission), shellrl:rollout:group:{id} (hash:
usable, lost, given_back, arrived (usable members scored), key (the first one's reward key),
varied (1 once another key was seen), seen:<trajectory_id>; kept `GROUP_ACCOUNTING_TTL_S`).
Check-and-admit, finish, member_lost and member_scored are one Lua script each, so several
gateway replicas share one bound.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.rollout import metrics as m
from services.rollout.policy_version import PolicyVersionWatcher
from shellrl.contract import ContractError, Trajectory, is_infra, parse_trajectory
from shellrl.rl.dynamic_sampling import reward_key
from shellrl.rl.staleness import admission_bound_terms, max_admitted_groups
from shellrl.streams import POLICY_VERSION_KEY, STREAM_EPISODES, StreamShards, idempotency_key
from shellrl.streams.keys import ADMITTED_KEY, INFLIGHT_KEY, group_accounting_key
from shellrl.streams.script_batch import ScriptCall

log = logging.getLogger(__name__)

MIN_USABLE = 2  # usable members a group needs to reach a learner step (1 has no baseline)
GROUP_ACCOUNTING_TTL_S = 24 * 3600  # how long a finished group's counts wait for verifier outcomes


# KEYS[1] policy version, KEYS[2] admitted counter, KEYS[3] in-flight zset
# ARGV[1] the bound at version 0, ARGV[2] groups per version (groups_per_step; both from
# shellrl.rl.staleness.admission_bound_terms), ARGV[3] strict 0/1, ARGV[4] member
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
local bound = tonumber(ARGV[1]) + base * tonumber(ARGV[2])
if admitted < bound then
  redis.call('INCR', KEYS[2])
  redis.call('ZADD', KEYS[3], v, ARGV[4])
  return {1, admitted + 1, v, bound}
end
return {0, admitted, v, bound}
"""

# Shared by the scripts below. Give-back reasons: 1 too few usable members, 2 zero variance.
_GROUP_FUNCTIONS = """
local function give_back(admitted, group, reason)
  redis.call('DECR', admitted)
  redis.call('HSET', group, 'given_back', 1)
  return reason
end
local function zero_variance_done(group, min_usable)
  local usable = redis.call('HGET', group, 'usable')
  if not usable or redis.call('HGET', group, 'given_back') == '1' then return false end
  if redis.call('HGET', group, 'varied') == '1' then return false end
  local left = tonumber(usable) - tonumber(redis.call('HGET', group, 'lost') or '0')
  return left >= min_usable and tonumber(redis.call('HGET', group, 'arrived') or '0') >= left
end
"""

# KEYS[1] admitted counter, KEYS[2] in-flight zset, KEYS[3] the group's accounting hash
# ARGV[1] member, ARGV[2] usable members at hand-off, ARGV[3] MIN_USABLE, ARGV[4] ttl (s),
# ARGV[5] dynamic sampling 0/1. Returns {removed 0/1, given back: 0 or the reason}.
_FINISH = (
    _GROUP_FUNCTIONS
    + """
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 0 then return {0, 0} end
local lost = tonumber(redis.call('HGET', KEYS[3], 'lost') or '0')
redis.call('HSET', KEYS[3], 'usable', ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[4])
if tonumber(ARGV[2]) - lost < tonumber(ARGV[3]) then
  return {1, give_back(KEYS[1], KEYS[3], 1)}
end
if ARGV[5] == '1' and zero_variance_done(KEYS[3], tonumber(ARGV[3])) then
  return {1, give_back(KEYS[1], KEYS[3], 2)}
end
return {1, 0}
"""
)

# KEYS[1] admitted counter, KEYS[2] the group's accounting hash
# ARGV[1] trajectory id, ARGV[2] MIN_USABLE, ARGV[3] ttl (s), ARGV[4] dynamic sampling 0/1
# Returns -1 (already counted), 0 (counted) or the give-back reason (counted, given back now).
_MEMBER_LOST = (
    _GROUP_FUNCTIONS
    + """
if redis.call('HSETNX', KEYS[2], 'lost:' .. ARGV[1], 1) == 0 then return -1 end
local lost = redis.call('HINCRBY', KEYS[2], 'lost', 1)
redis.call('EXPIRE', KEYS[2], ARGV[3])
local usable = redis.call('HGET', KEYS[2], 'usable')
if usable and redis.call('HGET', KEYS[2], 'given_back') ~= '1'
    and tonumber(usable) - lost < tonumber(ARGV[2]) then
  return give_back(KEYS[1], KEYS[2], 1)
end
if ARGV[4] == '1' and zero_variance_done(KEYS[2], tonumber(ARGV[2])) then
  return give_back(KEYS[1], KEYS[2], 2)
end
return 0
"""
)

# KEYS[1] admitted counter, KEYS[2] the group's accounting hash
# ARGV[1] trajectory id, ARGV[2] its reward key, ARGV[3] MIN_USABLE, ARGV[4] ttl (s),
# ARGV[5] dynamic sampling 0/1. Returns -1 (already counted), 0 (counted) or 2 (counted, and the
# group's admission given back: every usable member scored the same).
_MEMBER_SCORED = (
    _GROUP_FUNCTIONS
    + """
if redis.call('HSETNX', KEYS[2], 'seen:' .. ARGV[1], 1) == 0 then return -1 end
redis.call('HINCRBY', KEYS[2], 'arrived', 1)
local first = redis.call('HGET', KEYS[2], 'key')
if not first then
  redis.call('HSET', KEYS[2], 'key', ARGV[2])
elseif first ~= ARGV[2] then
  redis.call('HSET', KEYS[2], 'varied', 1)
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
if ARGV[5] == '1' and zero_variance_done(KEYS[2], tonumber(ARGV[3])) then
  return give_back(KEYS[1], KEYS[2], 2)
end
return 0
"""
)

_ZERO_VARIANCE = 2  # the give-back reason of dynamic sampling


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
        dynamic_sampling: bool = False,
        poll_s: float = 1.0,
        group_size: int | None = None,
        max_attempts: int = 1,
        shards: StreamShards | None = None,
    ) -> None:
        """group_size, max_attempts: the members a group's samples hand off as
        (`<group_id>-<index>-a<attempt>` on shellrl:episodes, rollout/worker.py), so that `recover`
        counts the usable members a dead replica had already handed off (None: counts none).
        shards: where shellrl:episodes is, by group (shellrl/streams/shards.py; None: `redis`)."""
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError("max_staleness >= 0 and groups_per_step >= 1")
        self.redis, self.watcher, self.replica = redis, watcher, replica
        self.max_staleness, self.groups_per_step, self.strict, self.poll_s = (
            max_staleness,
            groups_per_step,
            strict,
            poll_s,
        )
        self.dynamic_sampling = dynamic_sampling
        self._dynamic = "1" if dynamic_sampling else "0"
        self.group_size, self.max_attempts = group_size, max_attempts
        self.shards = shards
        self._bound_at_zero, self._groups_per_version = admission_bound_terms(
            max_staleness, groups_per_step
        )
        self._admit = redis.register_script(_ADMIT)
        self._finish = redis.register_script(_FINISH)
        self._member_lost = redis.register_script(_MEMBER_LOST)
        self._member_scored = redis.register_script(_MEMBER_SCORED)

    async def try_admit(self, group_id: str) -> Ticket | None:
        member = f"{self.replica}|{group_id}"
        ok, admitted, version, bound = await self._admit(
            keys=[POLICY_VERSION_KEY, ADMITTED_KEY, INFLIGHT_KEY],
            args=[
                self._bound_at_zero,
                self._groups_per_version,
                "1" if self.strict else "0",
                member,
            ],
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
        verifier already failed with INFRA (it will not reach a learner step), or (dynamic
        sampling) when every usable member was already scored with one reward key. Returns
        whether it was given back."""
        _, given_back = await self._end(ticket.member, ticket.group_id, usable)
        self.watcher.wake()
        return bool(given_back)

    async def member_lost(self, group_id: str, trajectory_id: str) -> bool:
        """The verifier failed a member of `group_id` with INFRA after hand-off (idempotent by
        `trajectory_id`). Gives the group's slot back when this leaves it below MIN_USABLE
        usable members, or (dynamic sampling) every remaining one scored with one reward key
        (once per group). Returns whether it was given back now."""
        call = self.member_lost_call(group_id, trajectory_id)
        return self.gave_back(await call.script(keys=call.keys, args=call.args))

    def member_lost_call(self, group_id: str, trajectory_id: str) -> ScriptCall:
        """`member_lost` as a call to run in a batch (`shellrl.streams.script_batch`); pass its
        reply to `gave_back`."""
        return ScriptCall(
            self._member_lost,
            [ADMITTED_KEY, group_accounting_key(group_id)],
            [trajectory_id, MIN_USABLE, GROUP_ACCOUNTING_TTL_S, self._dynamic],
        )

    async def member_scored(self, traj: Trajectory) -> bool:
        """A usable member of a training group was scored (the scored stream, stats.py;
        idempotent by trajectory id): its reward key (`shellrl.rl.dynamic_sampling.reward_key`)
        joins its group's. With dynamic sampling, the group's slot is given back once every usable
        member was scored with one key (after hand-off: `usable` must be known). Returns whether
        it was given back now. Callers pass only non-INFRA, non-eval trajectories."""
        call = self.member_scored_call(traj)
        return self.gave_back(await call.script(keys=call.keys, args=call.args))

    def member_scored_call(self, traj: Trajectory) -> ScriptCall:
        """`member_scored` as a call to run in a batch (`shellrl.streams.script_batch`); pass
        its reply to `gave_back`."""
        return ScriptCall(
            self._member_scored,
            [ADMITTED_KEY, group_accounting_key(traj.group_id)],
            [
                traj.trajectory_id,
                reward_key(traj.training_reward, traj.scored),
                MIN_USABLE,
                GROUP_ACCOUNTING_TTL_S,
                self._dynamic,
            ],
        )

    def gave_back(self, reply: int | bytes) -> bool:
        """Metrics and a wake-up for the reply of `member_lost_call` / `member_scored_call`:
        -1 already counted, 0 counted, > 0 the reason the group's admission was given back now.
        Returns whether it was given back now."""
        reason = int(reply)
        if reason <= 0:
            return False
        m.GROUPS_RELEASED.inc()
        if reason == _ZERO_VARIANCE:
            m.GROUPS_ZERO_VARIANCE.inc()
        self.watcher.wake()
        return True

    async def usable_members(self, group_id: str) -> int | None:
        """Usable members of a finished group as the gateway counts them now: at hand-off, minus
        the members the verifier failed with INFRA since (None: not finished, or forgotten)."""
        usable, lost = await self.redis.hmget(group_accounting_key(group_id), "usable", "lost")
        return None if usable is None else int(usable) - int(lost or 0)

    async def _end(self, member: str, group_id: str, usable: int) -> tuple[int, int]:
        removed, given_back = await self._finish(
            keys=[ADMITTED_KEY, INFLIGHT_KEY, group_accounting_key(group_id)],
            args=[member, usable, MIN_USABLE, GROUP_ACCOUNTING_TTL_S, self._dynamic],
        )
        if given_back:
            m.GROUPS_RELEASED.inc()
            if int(given_back) == _ZERO_VARIANCE:
                m.GROUPS_ZERO_VARIANCE.inc()
        return int(removed), int(given_back)

    async def recover(self, replica: str | None = None) -> int:
        """At start-up: groups this replica had in flight died with it; each ends as `finish`
        would with the usable members it had already handed off (`handed_off_usable`): a group
        whose samples all reached shellrl:episodes before the crash goes on to the learner and
        keeps its slot; one left below MIN_USABLE gives it back. (Before, every such group gave
        its slot back: a group handed off whole then trained uncounted, one past the bound.)
        With `replica`: the same for that (dead) replica. Returns how many groups."""
        replica = replica or self.replica
        prefix = f"{replica}|".encode()
        members = [
            mb for mb in await self.redis.zrange(INFLIGHT_KEY, 0, -1) if mb.startswith(prefix)
        ]
        given_back = 0
        for member in members:
            group_id = member.decode()[len(prefix) :]
            usable = await self.handed_off_usable(group_id)
            given_back += bool((await self._end(member.decode(), group_id, usable))[1])
        if members:
            log.warning(
                "ended the groups in flight at the last shutdown",
                extra={"groups": len(members), "given_back": given_back, "replica": replica},
            )
        return len(members)

    async def handed_off_usable(self, group_id: str) -> int:
        """Samples of `group_id` (index 0..group_size-1) of which an attempt is on
        shellrl:episodes (on the group's stream shard) without an INFRA failure, found through the
        stream's idempotency keys
        (entry ids). An entry trimmed since counts as not usable (the conservative side: the
        slot is given back, as before). 0 without `group_size`."""
        if not self.group_size:
            return 0
        names = [
            (index, f"{group_id}-{index}-a{attempt}")
            for index in range(self.group_size)
            for attempt in range(self.max_attempts)
        ]
        episodes = self.shards.for_group(group_id) if self.shards is not None else self.redis
        entry_ids = await episodes.mget(
            [idempotency_key(STREAM_EPISODES, name) for _, name in names]
        )
        usable: set[int] = set()
        for (index, _), entry_id in zip(names, entry_ids, strict=True):
            if not entry_id or index in usable:
                continue
            entries = await episodes.xrange(STREAM_EPISODES, entry_id, entry_id)
            try:
                handed_off = parse_trajectory(entries[0][1][b"pb"]) if entries else None
            except (ContractError, KeyError):  # not ours to judge here: not counted
                handed_off = None
            if handed_off is not None and not is_infra(handed_off.failure):
                usable.add(index)
        return len(usable)

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
            max_admitted_groups(base, self.max_staleness, self.groups_per_step),
            oldest_v,
            int(inflight),
        )
