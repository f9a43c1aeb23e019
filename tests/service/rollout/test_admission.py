"""Staleness-bounded admission on a real Redis: the bound, wake-ups, give-backs, restarts."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.admission import Admission
from services.rollout.policy_version import PolicyVersionWatcher
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import POLICY_UPDATES_CHANNEL, POLICY_VERSION_KEY, connect
from shellrl.streams.keys import ADMITTED_KEY
from tests.helpers.waiting import wait_until_async


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def admission(
    redis, *, k: int, b: int, strict: bool = True, replica: str = "rollout-0"
) -> Admission:
    return Admission(
        redis,
        PolicyVersionWatcher(redis, poll_s=0.05),
        replica=replica,
        max_staleness=k,
        groups_per_step=b,
        strict=strict,
        poll_s=0.05,
    )


async def test_learner_that_never_advances_gets_at_most_k_plus_1_times_groups_per_step_groups(
    redis,
):
    k, b = 2, 3
    replicas = [
        admission(redis, k=k, b=b, replica="rollout-0"),
        admission(redis, k=k, b=b, replica="rollout-1"),
    ]
    attempts = [asyncio.create_task(replicas[i % 2].admit(f"g{i}")) for i in range(20)]
    await wait_until_async(
        lambda: sum(t.done() for t in attempts) >= (k + 1) * b, 30, "the bound's groups admitted"
    )
    await asyncio.sleep(1.0)  # a bounded look: nothing more is admitted (never fails falsely)
    admitted = [t for t in attempts if t.done()]
    assert len(admitted) == (k + 1) * b == 9
    assert int(await redis.get(ADMITTED_KEY)) == 9
    await cancel_and_wait(*attempts)


async def test_max_staleness_zero_is_batch_synchronous_and_a_version_bump_wakes_admission(redis):
    adm = admission(redis, k=0, b=2)
    watcher = asyncio.create_task(adm.watcher.run())
    tickets = [await adm.admit("a"), await adm.admit("b")]
    waiting = asyncio.create_task(adm.admit("c"))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    for ticket in tickets:  # both groups reach the learner, which steps to version 1
        await adm.finish(ticket, usable=2)
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await redis.set(POLICY_VERSION_KEY, 1)
    await redis.publish(POLICY_UPDATES_CHANNEL, "1")
    third = await asyncio.wait_for(waiting, 2.0)
    assert (
        [t.policy_version for t in tickets] == [0, 0]
        and third.policy_version == 1
        and third.bound == 4
    )
    await cancel_and_wait(watcher)


async def test_strict_bound_waits_for_the_oldest_group_in_flight(redis):
    """A long-tail group admitted at version 0 keeps admission at (0 + k + 1) * B even after the
    learner moved on; the plain (DESIGN) rule would admit (5 + k + 1) * B."""
    strict, plain = (
        admission(redis, k=1, b=2),
        admission(redis, k=1, b=2, strict=False, replica="other"),
    )
    tail = await strict.admit("tail")
    for i in range(3):
        assert await strict.try_admit(f"x{i}") is not None
    await redis.set(POLICY_VERSION_KEY, 5)
    assert await strict.try_admit("blocked") is None
    assert (await strict.state()).bound == 4 and (await plain.state()).bound == 14
    assert await plain.try_admit("plain") is not None
    await strict.finish(tail, usable=2)  # the tail reached the learner
    assert (
        await strict.state()
    ).oldest_in_flight_version == 0  # x0..x2 were admitted at version 0 too
    assert await strict.try_admit("still-blocked") is None


async def test_a_group_given_back_frees_its_slot_and_the_counter_survives_a_redis_restart(
    redis_server, redis
):
    adm = admission(redis, k=0, b=2)
    first, second = await adm.admit("a"), await adm.admit("b")
    assert await adm.try_admit("c") is None
    await adm.finish(first, usable=1)  # fewer than 2 usable trajectories: never reaches the learner
    await adm.finish(second, usable=2)
    assert int(await redis.get(ADMITTED_KEY)) == 1
    await asyncio.sleep(1.1)  # appendfsync everysec
    redis_server.restart()
    await redis.connection_pool.disconnect()
    assert int(await redis.get(ADMITTED_KEY)) == 1
    assert await adm.try_admit("c") is not None and await adm.try_admit("d") is None


async def test_restarted_replica_gives_back_the_groups_it_had_in_flight_and_only_those(redis):
    mine, other = admission(redis, k=3, b=1), admission(redis, k=3, b=1, replica="rollout-1")
    await mine.admit("a")
    await mine.admit("b")
    await other.admit("c")
    restarted = admission(redis, k=3, b=1)
    assert await restarted.recover() == 2
    state = await restarted.state()
    assert state.groups_admitted == 1 and state.groups_in_flight == 1


async def test_missing_counter_starts_at_version_times_groups_per_step(redis):
    """AReaL's recovery rule: a fresh counter against a learner at version v assumes v steps of groups."""
    await redis.set(POLICY_VERSION_KEY, 4)
    adm = admission(redis, k=1, b=3)
    admitted = 0
    while await adm.try_admit(f"g{admitted}") is not None:
        admitted += 1
    assert admitted == (4 + 1 + 1) * 3 - 4 * 3 == 6


async def test_a_replica_restarted_mid_group_keeps_the_slots_of_groups_it_had_handed_off(redis):
    """Found by the chaos test under load: the gateway was killed after a group's two samples
    reached shellrl:episodes but before the group left flight; the restarted replica gave every
    such slot back, so that group trained uncounted and the learner saw 5 groups waiting against
    a bound of 4. Now `recover` ends each group with the usable members it had handed off (by
    the stream's idempotency keys, as the worker publishes them): whole or usable groups keep
    their slot, the rest give it back."""
    from shellrl.contract import Failure
    from shellrl.streams import STREAM_EPISODES, StreamProducer
    from tests.helpers.trajectories import make_trajectory

    mine = admission(redis, k=4, b=1)
    for group in ("whole", "half", "retried", "lost"):
        await mine.admit(group)
    episodes = StreamProducer(redis, STREAM_EPISODES)
    infra = Failure.FAILURE_INFRA_SANDBOX
    handed_off = {  # what the worker published before the crash: (sample, attempt, failure)
        "whole": [(0, 0, None), (1, 0, None)],
        "half": [(1, 0, None)],  # the other sample was running when the replica died
        "retried": [(0, 0, infra), (0, 1, None), (1, 0, None)],  # INFRA, then retried: usable
        "lost": [(0, 0, infra), (1, 0, None)],  # the INFRA one's retry never ran: 1 usable
    }
    for group, samples in handed_off.items():
        for index, attempt, failure in samples:
            name = f"{group}-{index}-a{attempt}"
            traj = make_trajectory(group, 0.0, trajectory_id=name, group_size=2)
            traj.failure = failure or Failure.FAILURE_NONE
            await episodes.add(traj.SerializeToString(), idempotency_key=name, group_id=group)
    restarted = Admission(
        redis,
        PolicyVersionWatcher(redis, poll_s=0.05),
        replica="rollout-0",
        max_staleness=4,
        groups_per_step=1,
        group_size=2,
        max_attempts=2,
    )
    assert [await restarted.handed_off_usable(g) for g in handed_off] == [2, 1, 2, 1]
    assert await restarted.recover() == 4
    state = await restarted.state()
    assert state.groups_in_flight == 0
    assert state.groups_admitted == 2  # "whole" and "retried" go on to the learner, counted
