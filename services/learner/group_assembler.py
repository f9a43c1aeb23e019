"""Group assembly: scored trajectories from the stream -> complete GRPO groups -> train samples.

Consumes parsed trajectories (with their stream entry ids) in any order; produces RolloutGroups
(the valid members of one `group_id`) once `group_size` samples arrived, or once
`group_timeout_s` passed since the first one arrived (then the group is used if at least
`min_group_size` valid members remain, else dropped). An INFRA failure of the rollout (engine,
sandbox, gateway) does not count as an arrived sample: the gateway re-runs that sample (attempt +
1) and publishes the retry too. A verifier INFRA failure has arrived for good: it is never re-run
(contract.is_rerun), so waiting for it would hold the group until `group_timeout_s`.

A released group `counts` toward a learner step when at least 2 of its samples did not fail
with INFRA (of either kind), whatever happens to them here (stale, unscored, zero variance). That is the
gateway's "usable" rule: it gives back the admission of a group with fewer than 2 usable samples
(services/rollout/worker.py), so learner versions and admitted groups stay in step. With dynamic
sampling (`dynamic_sampling=True`, shellrl/rl/dynamic_sampling.py) a group released complete whose
usable samples all have one reward key does not count either (`no_reward_variance`): the gateway
gave its admission back by the same rule on the same trajectories, and admitted another group in
its place, so each step trains groups with a gradient. A group released by the timeout counts by
the usable rule alone (its missing samples might have varied; the gateway, seeing them all, may
then give it back: a slot of slack, never a step that waits for a group that is not coming).
Guarantees:
* every trajectory handed in comes back exactly once, either as a member of a returned group or
  as a `Dropped` record with its reason (so every stream entry is eventually acknowledged);
* a member is valid only if: not an eval episode, scored, a finite training_reward, no INFRA
  failure (removed from the group, never scored 0; DESIGN.md section 5), at least one ACTION
  token, a finite behavior log-prob <= 0 on every loss-mask-1 token ("invalid_logprobs": one NaN
  would make the whole step skip; issue 15 item 4), and staleness <= max_staleness, checked both
  on arrival and again when the group is released (a trajectory that waits ages; known_pitfalls
  C18);
* duplicates by trajectory_id are dropped; members arriving after their group was released are
  dropped as `late_member` (released group ids are remembered, bounded).
train_samples.py turns a released group into TrainSamples.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from shellrl.contract import (
    Trajectory,
    TrajectoryArrays,
    is_infra,
    is_rerun,
    min_policy_version,
    trajectory_arrays,
)
from shellrl.rl.dynamic_sampling import has_variance, reward_key
from shellrl.rl.staleness import is_too_stale, staleness

_NOT_SAMPLES = frozenset({"infra_failure", "verifier_failure", "eval"})  # never usable
_AWAITING_RERUN = frozenset(
    {"infra_failure", "eval"}
)  # not an arrival: a re-run follows (or none is due)
DROP_REASONS = (
    "stale",
    "infra_failure",
    "verifier_failure",
    "unscored",
    "nan_reward",
    "eval",
    "empty_response",
    "duplicate",
    "invalid",
    "invalid_logprobs",
    "late_member",
    "group_too_small",
)


@dataclass(frozen=True)
class Member:
    """One valid trajectory waiting in (or released with) its group."""

    entry_id: str
    trajectory: Trajectory
    arrays: TrajectoryArrays
    min_policy_version: int
    arrived_s: float

    @property
    def trajectory_id(self) -> str:
        return self.trajectory.trajectory_id


@dataclass(frozen=True)
class Dropped:
    """A stream entry that will not be trained on, and why (one of DROP_REASONS)."""

    entry_id: str
    trajectory_id: str
    group_id: str
    reason: str
    staleness: int | None = None


@dataclass(frozen=True)
class RolloutGroup:
    """A released group: its valid members (empty when the whole group was dropped) and the
    entries dropped from it. `timed_out`: released by the timeout, not by completeness."""

    group_id: str
    members: tuple[Member, ...]
    dropped: tuple[Dropped, ...]
    expected_size: int
    timed_out: bool
    no_reward_variance: bool = False  # dynamic sampling: complete, one reward key: not counted

    @property
    def entry_ids(self) -> list[str]:
        return [m.entry_id for m in self.members] + [d.entry_id for d in self.dropped]

    @property
    def trainable(self) -> bool:
        return len(self.members) >= 2

    @property
    def counts(self) -> bool:
        """Whether this group uses one of the `groups_per_step` slots of a learner step."""
        usable = len(self.members) + sum(d.reason not in _NOT_SAMPLES for d in self.dropped)
        return usable >= 2 and not self.no_reward_variance


@dataclass
class _Pending:
    group_id: str
    expected_size: int
    first_arrival_s: float
    members: dict[str, Member] = field(default_factory=dict)
    dropped: list[Dropped] = field(default_factory=list)
    reward_keys: dict[str, str] = field(default_factory=dict)  # usable samples: id -> reward key

    @property
    def arrivals(self) -> int:
        """Samples arrived (rollout INFRA failures are re-run by the gateway: they do not count; a
        verifier failure does, no re-run follows it)."""
        return len(self.members) + sum(d.reason not in _AWAITING_RERUN for d in self.dropped)


class GroupAssembler:
    """group_timeout_s: seconds after a group's first arrival before it is released incomplete;
    max_staleness: versions; min_group_size: valid members a released group needs (>= 2);
    remember_groups: how many released group ids are kept to recognise late members;
    dynamic_sampling: complete groups without reward variance do not count (module docstring)."""

    def __init__(
        self,
        *,
        group_timeout_s: float,
        max_staleness: int,
        min_group_size: int = 2,
        remember_groups: int = 100_000,
        clock=time.monotonic,
        dynamic_sampling: bool = False,
    ) -> None:
        if min_group_size < 2:
            raise ValueError(
                f"min_group_size must be >= 2 (a group of 1 has no baseline); got {min_group_size}"
            )
        self.group_timeout_s, self.max_staleness, self.min_group_size = (
            group_timeout_s,
            max_staleness,
            min_group_size,
        )
        self.remember_groups, self.clock = remember_groups, clock
        self.dynamic_sampling = dynamic_sampling
        self._pending: dict[str, _Pending] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._held: set[str] = set()  # entry ids in pending groups

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def pending_trajectories(self) -> int:
        return sum(len(p.members) + len(p.dropped) for p in self._pending.values())

    def add(self, entry_id: str, traj: Trajectory, learner_version: int) -> Dropped | None:
        """Take one trajectory. Returns a Dropped record when it is rejected on its own (it is then
        not held); otherwise None (held, or counted as a dropped member of its pending group, or
        the same stream entry delivered again while held: ignored)."""
        if entry_id in self._held:
            return None
        group_id = traj.group_id or traj.trajectory_id
        if group_id in self._released:
            return Dropped(entry_id, traj.trajectory_id, group_id, "late_member")
        pending = self._pending.get(group_id)
        if pending is None:
            pending = self._pending[group_id] = _Pending(
                group_id, int(traj.group_size), self.clock()
            )
        if traj.trajectory_id in pending.members or any(
            d.trajectory_id == traj.trajectory_id for d in pending.dropped
        ):
            return Dropped(entry_id, traj.trajectory_id, group_id, "duplicate")
        reason, arrays, oldest = _validate(traj)
        if not traj.eval and not is_infra(traj.failure):
            pending.reward_keys[traj.trajectory_id] = reward_key(traj.training_reward, traj.scored)
        stale = None
        if reason is None:
            stale = staleness(learner_version, oldest)
            if is_too_stale(learner_version, oldest, self.max_staleness):
                reason = "stale"
        if reason is not None:
            pending.dropped.append(Dropped(entry_id, traj.trajectory_id, group_id, reason, stale))
        else:
            pending.members[traj.trajectory_id] = Member(
                entry_id, traj, arrays, oldest, self.clock()
            )
        self._held.add(entry_id)
        return None

    def pop_ready(self, learner_version: int) -> list[RolloutGroup]:
        """Release complete groups and timed-out ones (oldest first), re-checking staleness."""
        now, out = self.clock(), []
        for group_id, pending in sorted(
            self._pending.items(), key=lambda kv: kv[1].first_arrival_s
        ):
            complete = pending.expected_size > 0 and pending.arrivals >= pending.expected_size
            timed_out = now - pending.first_arrival_s >= self.group_timeout_s
            if complete or timed_out:
                out.append(self._release(pending, learner_version, timed_out=not complete))
        for group in out:
            del self._pending[group.group_id]
            self._held.difference_update(group.entry_ids)
            self._released[group.group_id] = None
            while len(self._released) > self.remember_groups:
                self._released.popitem(last=False)
        return out

    def _release(self, pending: _Pending, learner_version: int, timed_out: bool) -> RolloutGroup:
        group = RolloutGroup(
            pending.group_id,
            tuple(pending.members.values()),
            tuple(pending.dropped),
            pending.expected_size,
            timed_out,
            no_reward_variance=self.dynamic_sampling
            and not timed_out
            and not has_variance(pending.reward_keys.values()),
        )
        return self.recheck(group, learner_version)

    def recheck(self, group: RolloutGroup, learner_version: int) -> RolloutGroup:
        """The group as it may be trained at `learner_version`: members staler than max_staleness
        dropped ("stale"), and all of them ("group_too_small") when fewer than min_group_size remain.
        Call it again right before training: a released group may wait for a later step."""
        members, dropped = [], list(group.dropped)
        for m in group.members:
            stale = staleness(learner_version, m.min_policy_version)
            if is_too_stale(learner_version, m.min_policy_version, self.max_staleness):
                dropped.append(Dropped(m.entry_id, m.trajectory_id, group.group_id, "stale", stale))
            else:
                members.append(m)
        if len(members) < self.min_group_size:
            dropped += [
                Dropped(m.entry_id, m.trajectory_id, group.group_id, "group_too_small")
                for m in members
            ]
            members = []
        return replace(group, members=tuple(members), dropped=tuple(dropped))

    def released_group_ids(self) -> list[str]:
        """For checkpoints: the remembered released group ids, oldest first."""
        return list(self._released)

    def restore_released(self, group_ids: list[str]) -> None:
        for g in group_ids[-self.remember_groups :]:
            self._released[g] = None


def _validate(traj: Trajectory) -> tuple[str | None, TrajectoryArrays | None, int | None]:
    if traj.eval:
        return "eval", None, None
    if is_infra(traj.failure):
        return ("infra_failure" if is_rerun(traj.failure) else "verifier_failure"), None, None
    if not traj.scored:
        return "unscored", None, None
    if not math.isfinite(traj.training_reward):
        return "nan_reward", None, None
    try:
        arrays = trajectory_arrays(traj)
    except ValueError:
        return "invalid", None, None
    oldest = min_policy_version(traj)
    if oldest is None or not arrays.loss_mask.any() or len(arrays.prompt_ids) == 0:
        return "empty_response", None, None
    scored = arrays.behavior_logprobs[arrays.loss_mask == 1]
    if not (np.isfinite(scored).all() and (scored <= 0).all()):
        return "invalid_logprobs", None, None
    return None, arrays, oldest
