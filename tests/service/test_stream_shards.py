"""The training streams sharded across Redis instances (shellrl/streams/shards.py), on real
redis-servers: a control Redis and two stream shards. The verifier's stream worker, built as the
service builds it, forwards every group's episodes on the group's own shard and evaluations on the
control Redis; a learner-side consumer takes every trajectory from both shards with tagged ids
and acknowledges each on its own shard; the gateway finds a group's handed-off episodes and a
trajectory's transcript on the group's shard."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.admission import Admission
from services.rollout.transcripts import find_task_trajectories, find_trajectory
from services.verifier.parts import build_verifier, build_worker
from services.verifier.settings import VerifierSettings
from shellrl.contract import EpisodeEnd, Trajectory, task_from_json
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import (
    GROUP_LEARNER,
    GROUP_VERIFIER,
    STREAM_DEAD,
    STREAM_EPISODES,
    STREAM_EVALUATIONS,
    STREAM_TRAJECTORIES,
    ShardedStreamConsumer,
    StreamShards,
    connect,
    idempotency_key,
    shard_of,
    untag,
)
from tests.helpers.redis_server import RedisServer
from tests.helpers.waiting import wait_until_async

TASK = task_from_json(
    {
        "task_id": "t-five",
        "instruction": "Say 5.",
        "check": {"type": "answer_integer_equals", "expected": 5},
    }
)


@pytest.fixture
def shard_servers(tmp_path):
    servers = [RedisServer(tmp_path / f"shard-{k}").start() for k in (1, 2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
async def shards(redis_server, shard_servers):
    control = connect(redis_server.url)
    shards = StreamShards(control, [s.url for s in shard_servers])
    yield shards
    await shards.aclose()
    await control.aclose()


def _episode(group: int, member: int) -> Trajectory:
    return Trajectory(
        trajectory_id=f"g{group}-{member}-a0",
        task_id=TASK.task_id,
        group_id=f"g{group}",
        task=TASK,
        answer="5",
        end=EpisodeEnd.EPISODE_END_ANSWER,
    )


async def _publish(shards: StreamShards, traj: Trajectory) -> None:
    """As the gateway publishes (services/rollout/worker.py `publish`)."""
    producer = shards.producer(STREAM_EPISODES)
    await producer.add_retrying(
        traj.SerializeToString(),
        idempotency_key=traj.trajectory_id,
        task_id=traj.task_id,
        group_id=traj.group_id,
        version=0,
    )


async def _lengths(shards: StreamShards, stream: str) -> list[int]:
    return [int(await c.xlen(stream)) for c in shards.clients]


async def test_the_verifier_forwards_each_group_on_its_shard_and_a_learner_takes_all(
    redis_server, shard_servers, shards
):
    groups = 10
    settings = VerifierSettings(
        redis_url=redis_server.url,
        stream_shard_urls=",".join(s.url for s in shard_servers),
        block_ms=200,
    )
    worker = build_worker(settings, shards.clients[0], build_verifier(settings, None), None)
    assert isinstance(worker.consumer, ShardedStreamConsumer)
    for g in range(groups):
        for member in (0, 1):
            await _publish(shards, _episode(g, member))
    evaluation = Trajectory(
        trajectory_id="eval-1", task_id=TASK.task_id, task=TASK, answer="5", eval=True,
        end=EpisodeEnd.EPISODE_END_ANSWER,
    )  # fmt: skip
    await _publish(shards, evaluation)  # no group id: the control Redis
    expected = [0, 0, 0]
    for g in range(groups):
        expected[shard_of(f"g{g}", 2)] += 2
    assert expected[1] and expected[2], "ten groups land on both shards"
    assert await _lengths(shards, STREAM_EPISODES) == [1, expected[1], expected[2]]

    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    try:

        async def all_forwarded() -> bool:
            return (await _lengths(shards, STREAM_TRAJECTORIES))[1:] == expected[1:] and (
                await shards.clients[0].xlen(STREAM_EVALUATIONS)
            ) == 1

        await wait_until_async(all_forwarded, timeout_s=60, what="every episode forwarded")
    finally:
        stop.set()
        await worker.drain(5.0)
        await cancel_and_wait(run)
        await worker.consumer.close()
    assert await shards.clients[0].xlen(STREAM_TRAJECTORIES) == 0
    for k, client in enumerate(shards.clients):
        assert (await client.xpending(STREAM_EPISODES, GROUP_VERIFIER))["pending"] == 0
        assert await client.xlen(STREAM_DEAD) == 0
        for _, fields in await client.xrange(STREAM_TRAJECTORIES):
            traj = Trajectory.FromString(fields[b"pb"])
            assert traj.reward == 1.0 and shard_of(traj.group_id, 2) == k

    learner = shards.consumer(STREAM_TRAJECTORIES, GROUP_LEARNER, "learner-0", block_ms=200)
    await learner.ensure_group()
    taken: dict[str, str] = {}
    never = asyncio.Event()
    try:

        async def took_all() -> bool:
            for entry in await learner.take(never):
                taken[entry.entry_id] = Trajectory.FromString(entry.pb).group_id
            return len(taken) == 2 * groups

        await wait_until_async(took_all, timeout_s=30, what="every trajectory taken")
        for entry_id, group_id in taken.items():
            assert untag(entry_id)[0] == shard_of(group_id, 2)  # "<k>@<id>" names its shard
        assert await learner.ack(*taken) == 2 * groups
    finally:
        await learner.close()
    for client in shards.clients[1:]:
        assert (await client.xpending(STREAM_TRAJECTORIES, GROUP_LEARNER))["pending"] == 0


async def test_an_entry_of_a_shard_is_never_forwarded_to_the_control_redis(shards):
    """shellrl:evaluations lives on the control Redis: an episode read from a stream shard cannot
    go there in the one atomic forward, so the forward refuses and the entry stays pending."""
    await _publish(shards, _episode(1, 0))
    k = shard_of("g1", 2)
    consumer = shards.consumer(STREAM_EPISODES, GROUP_VERIFIER, "v-0", block_ms=200)
    await consumer.ensure_group()
    never = asyncio.Event()
    try:
        entries: list = []

        async def took_one() -> bool:
            entries.extend(await consumer.take(never))
            return bool(entries)

        await wait_until_async(took_one, timeout_s=30, what="the episode taken")
        evaluations = shards.producer(STREAM_EVALUATIONS).for_shard(0)
        with pytest.raises(ValueError, match="cannot be forwarded"):
            await consumer.forward(entries[0], evaluations, b"x", idempotency_key="x")
    finally:
        await consumer.close()
    assert (await shards.clients[k].xpending(STREAM_EPISODES, GROUP_VERIFIER))["pending"] == 1
    assert await shards.clients[0].xlen(STREAM_EVALUATIONS) == 0


async def test_the_gateway_finds_a_groups_episodes_and_transcripts_on_its_shard(shards):
    g = next(i for i in range(100) if shard_of(f"g{i}", 2) == 2)  # a group on the last shard
    for member in (0, 1):
        await _publish(shards, _episode(g, member))
    plain = Admission(
        shards.clients[0], None, replica="r", max_staleness=1, groups_per_step=1, group_size=2
    )
    sharded = Admission(
        shards.clients[0], None, replica="r", max_staleness=1, groups_per_step=1, group_size=2,
        shards=shards,
    )  # fmt: skip
    assert await plain.handed_off_usable(f"g{g}") == 0  # looked on the control Redis only
    assert await sharded.handed_off_usable(f"g{g}") == 2

    scored = _episode(g, 0)
    scored.reward = 1.0
    producer = shards.producer(STREAM_TRAJECTORIES)
    entry_id, _ = await producer.add(
        scored.SerializeToString(),
        idempotency_key=scored.trajectory_id,
        task_id=scored.task_id,
        group_id=scored.group_id,
    )
    assert await shards.clients[2].get(idempotency_key(STREAM_TRAJECTORIES, scored.trajectory_id))
    found = await find_trajectory(shards.clients[0], scored.trajectory_id, shards.clients[1:])
    assert found is not None
    traj, stream, tagged = found
    assert (traj.trajectory_id, stream, tagged) == (
        scored.trajectory_id, STREAM_TRAJECTORIES, f"2@{entry_id}"
    )  # fmt: skip
    assert await find_trajectory(shards.clients[0], scored.trajectory_id) is None
    listed = await find_task_trajectories(shards.clients[0], TASK.task_id, 5, shards.clients[1:])
    assert [(t.trajectory_id, e) for t, _, e in listed] == [(scored.trajectory_id, tagged)]


async def test_a_shard_whose_read_fails_never_costs_the_entries_another_shard_delivered(shards):
    """A named injected fault: shard 2's take raises once shard 1's has delivered. The entries of
    shard 1 come back (tagged), the failure is raised only by a call in which nothing else came,
    and the next calls read shard 2 again."""
    g = next(i for i in range(100) if shard_of(f"g{i}", 2) == 1)
    await _publish(shards, _episode(g, 0))
    consumer = shards.consumer(STREAM_EPISODES, GROUP_VERIFIER, "v-0", block_ms=200)
    await consumer.ensure_group()
    delivered = asyncio.Event()
    one, two = consumer.shards[1], consumer.shards[2]
    real_take_one, real_take_two = one.take, two.take

    async def take_one(stop, count=None):
        try:
            return await real_take_one(stop, count)
        finally:
            delivered.set()

    failed = []

    async def failing_once_after_one(stop, count=None):  # FailsOnceAfterShardOne
        if not failed:
            await delivered.wait()
            failed.append(True)
            raise RuntimeError("injected: shard 2 read failed")
        return await real_take_two(stop, count)

    one.take, two.take = take_one, failing_once_after_one
    never = asyncio.Event()
    try:
        first = await consumer.take(never)
        assert [untag(e.entry_id)[0] for e in first] == [1]
        assert Trajectory.FromString(first[0].pb).group_id == f"g{g}"
        # shard 2's failure surfaces in a call that got nothing else, or was logged with `first`
        try:
            again = await consumer.take(never)
        except RuntimeError as exc:
            assert "injected" in str(exc)
            again = await consumer.take(never)
        assert again == [] and failed == [True]
    finally:
        await consumer.close()
