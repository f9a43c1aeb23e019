"""Dynamic sampling (DAPO) on a real Redis: the gateway's admission gives a zero-variance group's
slot back, and the learner's GroupAssembler counts exactly the groups the gateway kept.

Scored trajectories go through the real stream `shellrl:trajectories`, the gateway's real stats
consumer (TaskStats -> Admission.member_scored / member_lost) and the learner's real
GroupAssembler, as in a run; only the episodes themselves are built (tests/helpers/trajectories).
"""

from __future__ import annotations

import asyncio

import pytest

from services.learner.group_assembler import GroupAssembler
from services.rollout.admission import Admission
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.stats import GROUP_STATS, TaskStats
from services.rollout.task_store import TaskStore
from shellrl.contract import Failure, parse_trajectory
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import STREAM_TRAJECTORIES, StreamProducer, connect
from shellrl.streams.keys import ADMITTED_KEY
from tests.helpers.trajectories import make_trajectory
from tests.helpers.waiting import wait_until_async


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def make_admission(redis, *, dynamic: bool) -> Admission:
    return Admission(
        redis,
        PolicyVersionWatcher(redis, poll_s=0.05),
        replica="rollout-0",
        max_staleness=10,
        groups_per_step=1,
        dynamic_sampling=dynamic,
        poll_s=0.05,
    )


def group(group_id: str, rewards, failures=None) -> list:
    failures = failures or {}
    return [
        make_trajectory(
            group_id,
            r,
            trajectory_id=f"{group_id}-{i}-a0",
            group_size=len(rewards),
            failure=failures.get(i, Failure.FAILURE_NONE),
            scored=i not in failures,
        )
        for i, r in enumerate(rewards)
    ]


async def publish(redis, trajectories) -> None:
    producer = StreamProducer(redis, STREAM_TRAJECTORIES)
    for t in trajectories:
        await producer.add(t.SerializeToString(), group_id=t.group_id)


async def run_stats(redis, admission: Admission) -> None:
    """The gateway's stats consumer until it has taken every scored trajectory."""
    stats = TaskStats(redis, TaskStore(redis), admission, consumer="rollout-test", block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(stats.run(stop))
    backlog = StreamProducer(redis, STREAM_TRAJECTORIES)
    try:
        await wait_until_async(
            lambda: _is_zero(backlog.backlog(GROUP_STATS)),
            timeout_s=30,
            what="the stats consumer to take every scored trajectory",
        )
    finally:
        stop.set()
        await cancel_and_wait(task)


async def learner_counts(redis, *, dynamic: bool) -> dict[str, bool]:
    assembler = GroupAssembler(group_timeout_s=3600.0, max_staleness=10, dynamic_sampling=dynamic)
    for entry_id, fields in await redis.xrange(STREAM_TRAJECTORIES):
        assert assembler.add(entry_id.decode(), parse_trajectory(fields[b"pb"]), 0) is None
    return {g.group_id: g.counts for g in assembler.pop_ready(learner_version=0)}


async def test_zero_variance_group_gives_its_slot_back_once_scored_before_or_after_hand_off(redis):
    admission = make_admission(redis, dynamic=True)
    early = await admission.admit("g-early")  # scored before the gateway hands it off
    late = await admission.admit("g-late")  # handed off first, scored after
    mixed = await admission.admit("g-mixed")
    assert int(await redis.get(ADMITTED_KEY)) == 3
    for t in group("g-early", [0.0, 0.0, 0.0]):
        assert await admission.member_scored(t) is False  # usable not known before hand-off
    assert await admission.finish(early, usable=3) is True
    assert await admission.finish(late, usable=3) is False
    assert await admission.finish(mixed, usable=3) is False
    results = [await admission.member_scored(t) for t in group("g-late", [1.0, 1.0, 1.0])]
    assert results == [False, False, True]  # the last one completes the group
    assert await admission.member_scored(group("g-late", [1.0, 1.0, 1.0])[2]) is False  # again
    for t in group("g-mixed", [0.0, 1.0, 0.0]):
        assert await admission.member_scored(t) is False
    assert int(await redis.get(ADMITTED_KEY)) == 1  # only the group with a gradient counts


async def test_without_dynamic_sampling_a_zero_variance_group_keeps_its_slot(redis):
    admission = make_admission(redis, dynamic=False)
    ticket = await admission.admit("g-flat")
    await admission.finish(ticket, usable=2)
    for t in group("g-flat", [0.0, 0.0]):
        assert await admission.member_scored(t) is False
    assert int(await redis.get(ADMITTED_KEY)) == 1


@pytest.mark.parametrize("dynamic", [True, False])
async def test_gateway_and_learner_count_the_same_groups(redis, dynamic):
    """Through the stream and the stats consumer: varied, flat (0 and 1), a flat group whose one
    differing member the verifier failed (INFRA: not usable), a group whose differing member was
    not scored (a distinct key), and shaped training rewards that differ by 0.1."""
    admission = make_admission(redis, dynamic=dynamic)
    infra = {2: Failure.FAILURE_INFRA_VERIFIER}
    groups = {
        "g-varied": group("g-varied", [1.0, 0.0, 0.0]),
        "g-zeros": group("g-zeros", [0.0, 0.0, 0.0]),
        "g-ones": group("g-ones", [1.0, 1.0, 1.0]),
        "g-flat-after-loss": group("g-flat-after-loss", [0.0, 0.0, 1.0], infra),
        "g-unscored": group("g-unscored", [0.0, 0.0, 0.0], {1: Failure.FAILURE_TIMEOUT_BUDGET}),
        "g-shaped": group("g-shaped", [0.1, 0.2, 0.1]),
    }
    for group_id in groups:
        await admission.finish(await admission.admit(group_id), usable=3)
    await publish(redis, [t for g in groups.values() for t in g])
    await run_stats(redis, admission)

    counts = await learner_counts(redis, dynamic=dynamic)
    kept = {"g-varied", "g-unscored", "g-shaped"} if dynamic else set(groups)
    assert {g for g, c in counts.items() if c} == kept
    assert int(await redis.get(ADMITTED_KEY)) == len(kept)


async def test_a_group_released_by_the_timeout_counts_by_the_usable_rule_alone(redis):
    """The learner cannot know how missing members would have scored: it counts a timed-out
    group with 2+ usable members (the gateway may give it back later: slack, never a stall)."""
    clock = [0.0]
    assembler = GroupAssembler(
        group_timeout_s=10.0, max_staleness=10, dynamic_sampling=True, clock=lambda: clock[0]
    )
    for i, t in enumerate(group("g-partial", [0.0, 0.0, 0.0, 0.0])[:2]):
        assert assembler.add(f"1-{i}", t, 0) is None
    assert assembler.pop_ready(0) == []
    clock[0] = 11.0
    [released] = assembler.pop_ready(0)
    assert released.timed_out and released.counts and not released.no_reward_variance


async def _is_zero(awaitable) -> bool:
    return await awaitable == 0
