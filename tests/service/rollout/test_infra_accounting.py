"""INFRA failures are counted the same way by the gateway and the learner, on a real Redis.

A group goes through the real gateway (`RolloutWorker.run_group` with a scripted agent: an engine
failure that the gateway re-runs, and members whose sandbox sessions the verifier cannot inspect),
the real verifier worker (FAILURE_INFRA_VERIFIER for those members), the gateway's stats consumer
(which counts the verifier's losses into admission) and the learner's `GroupAssembler`. A member
the verifier failed is not re-run (docs/design-notes.md, "INFRA failures after the rollout"); both
sides must count the same usable members, and a group left below 2 gives its admission back.
"""

from __future__ import annotations

import asyncio

import pytest

from services.learner.group_assembler import GroupAssembler, RolloutGroup
from services.rollout.admission import Admission
from services.rollout.gates import Capacity, InfraGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.stats import GROUP_STATS, TaskStats
from services.rollout.task_store import TaskStore
from services.rollout.worker import RolloutConfig, RolloutWorker, usable_members
from services.verifier.parts import build_verifier
from services.verifier.settings import VerifierSettings
from services.verifier.worker import VerifierWorker
from shellrl.contract import Failure, parse_trajectory, task_from_json
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import (
    GROUP_VERIFIER,
    STREAM_EPISODES,
    STREAM_TRAJECTORIES,
    StreamConsumer,
    StreamProducer,
    connect,
)
from shellrl.streams.keys import ADMITTED_KEY, STREAM_EVALUATIONS
from tests.fakes.scripted_agent import ScriptedAgent
from tests.helpers.waiting import wait_until_async

TASK = task_from_json(
    {
        "task_id": "t-five",
        "instruction": "Say 5.",
        "check": {"type": "answer_integer_equals", "expected": 5},
    }
)


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def make_admission(redis) -> Admission:
    return Admission(
        redis,
        PolicyVersionWatcher(redis, poll_s=0.05),
        replica="rollout-0",
        max_staleness=10,
        groups_per_step=1,
        poll_s=0.05,
    )


async def gateway_group(
    redis, admission: Admission, agent: ScriptedAgent, group_id: str, size: int
) -> int:
    """One group through the gateway's `run_group`; returns its usable members at hand-off."""
    capacity = Capacity(size)
    gate = InfraGate({"engine": _answers, "sandbox": _answers}, poll_s=0.05)  # up again at once
    worker = RolloutWorker(
        redis,
        TaskStore(redis),
        None,
        admission,
        agent,
        capacity,
        gate,
        RolloutConfig(group_size=size, max_attempts=2, retry_backoff_s=0.0),
    )
    await capacity.acquire(size)  # what the main loop does before admitting a group
    trajectories = await worker.run_group(TASK, await admission.admit(group_id))
    return usable_members(trajectories)


async def verify_all(redis, expected: int) -> None:
    """The verifier's stream worker over shellrl:episodes until `expected` results are forwarded.
    It has no sandbox: a member with a sandbox session fails with FAILURE_INFRA_VERIFIER."""
    verifier = build_verifier(VerifierSettings(), sandbox=None)
    consumer = StreamConsumer(redis, STREAM_EPISODES, GROUP_VERIFIER, "verifier-test", block_ms=100)
    worker = VerifierWorker(
        consumer,
        StreamProducer(redis, STREAM_TRAJECTORIES),
        StreamProducer(redis, STREAM_EVALUATIONS),
        verifier,
        None,
        concurrency=4,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_until_async(
            lambda: _xlen_at_least(redis, STREAM_TRAJECTORIES, expected),
            timeout_s=30,
            what=f"{expected} verified trajectories",
        )
    finally:
        stop.set()
        await worker.drain(5.0)
        await cancel_and_wait(task)


async def count_losses(redis, admission: Admission) -> None:
    """The gateway's stats consumer over shellrl:trajectories, until it has taken every entry."""
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


async def learner_groups(redis) -> dict[str, RolloutGroup]:
    """The learner's GroupAssembler over shellrl:trajectories (released at once: a member the
    verifier failed is never re-run: it has arrived, so its group is complete without a timeout)."""
    assembler = GroupAssembler(group_timeout_s=3600.0, max_staleness=10)
    for entry_id, fields in await redis.xrange(STREAM_TRAJECTORIES):
        traj = parse_trajectory(fields[b"pb"])
        assert assembler.add(entry_id.decode(), traj, learner_version=0) is None
    return {g.group_id: g for g in assembler.pop_ready(learner_version=0)}


def learner_usable(group: RolloutGroup) -> int:
    """Usable members as `RolloutGroup.counts` counts them: members, plus dropped samples that
    were not INFRA (here: valid members dropped with a group too small)."""
    return len(group.members) + sum(
        d.reason not in ("infra_failure", "verifier_failure") for d in group.dropped
    )


async def test_a_verifier_failure_counts_the_same_for_the_gateway_and_the_learner(redis):
    await TaskStore(redis).submit(TASK)
    admission = make_admission(redis)
    four = ScriptedAgent("5", engine_failures=frozenset({1}), keep_session=frozenset({3}))
    two = ScriptedAgent("5", keep_session=frozenset({1}))
    assert await gateway_group(redis, admission, four, "g-four", 4) == 4  # engine failure re-run
    assert await gateway_group(redis, admission, two, "g-two", 2) == 2
    assert "g-four-1-a1" in four.runs and len(four.runs) == 5 and len(two.runs) == 2
    assert int(await redis.get(ADMITTED_KEY)) == 2  # both had 2+ usable members at hand-off

    await verify_all(redis, expected=5 + 2)
    scored = [parse_trajectory(f[b"pb"]) for _, f in await redis.xrange(STREAM_TRAJECTORIES)]
    failures = {t.trajectory_id: t.failure for t in scored if t.failure != Failure.FAILURE_NONE}
    assert failures == {
        "g-four-1-a0": Failure.FAILURE_INFRA_ENGINE,
        "g-four-3-a0": Failure.FAILURE_INFRA_VERIFIER,
        "g-two-1-a0": Failure.FAILURE_INFRA_VERIFIER,
    }

    await count_losses(redis, admission)
    groups = await learner_groups(redis)
    for group_id, usable in (("g-four", 3), ("g-two", 1)):
        assert await admission.usable_members(group_id) == usable
        assert learner_usable(groups[group_id]) == usable
        assert groups[group_id].counts == (usable >= 2)
    assert len(groups["g-four"].members) == 3 and groups["g-two"].members == ()
    assert four.runs.count("g-four-3-a1") == 0  # a member the verifier failed is not re-run
    assert int(await redis.get(ADMITTED_KEY)) == 1  # g-two never reaches a learner step: given back


async def test_a_loss_counted_before_the_hand_off_gives_back_once(redis):
    """The verifier can finish one member before the gateway finishes its group: the loss counts
    at hand-off, and counting it (or another loss) again gives nothing back twice."""
    admission = make_admission(redis)
    ticket = await admission.admit("g-early")
    assert await admission.member_lost("g-early", "g-early-0-a0") is False  # group still in flight
    assert await admission.finish(ticket, usable=2) is True  # 2 - 1 < 2: given back at hand-off
    assert int(await redis.get(ADMITTED_KEY)) == 0
    assert await admission.member_lost("g-early", "g-early-0-a0") is False  # the same loss again
    assert await admission.member_lost("g-early", "g-early-1-a0") is False  # already given back
    assert int(await redis.get(ADMITTED_KEY)) == 0
    assert await admission.usable_members("g-early") == 0

    kept = await admission.admit("g-kept")
    assert await admission.finish(kept, usable=3) is False
    assert await admission.member_lost("g-kept", "g-kept-2-a0") is False  # 2 usable left
    assert await admission.member_lost("g-kept", "g-kept-2-a0") is False  # again: counted once
    assert await admission.usable_members("g-kept") == 2 and int(await redis.get(ADMITTED_KEY)) == 1
    assert await admission.member_lost("g-kept", "g-kept-0-a0") is True  # 1 left: given back now
    assert int(await redis.get(ADMITTED_KEY)) == 0


async def _answers() -> bool:
    return True


async def _xlen_at_least(redis, stream: str, n: int) -> bool:
    return int(await redis.xlen(stream)) >= n


async def _is_zero(awaitable) -> bool:
    return await awaitable == 0
