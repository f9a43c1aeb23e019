"""A group's task counters (episodes started, finished, in flight) are right however the group
ends, on a real Redis: counters go by group commit beside the samples (TaskStore, worker.py
`run_group`), and a group cancelled before some of its samples began gives their in-flight count
back (before, one cancelled in its first loop turn left its whole size in flight for good)."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.admission import Admission
from services.rollout.gates import Capacity, InfraGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from services.rollout.worker import RolloutConfig, RolloutWorker
from shellrl.contract import task_from_json
from shellrl.streams import connect
from tests.fakes.scripted_agent import ScriptedAgent

TASK = task_from_json(
    {
        "task_id": "t-five",
        "instruction": "Say 5.",
        "check": {"type": "answer_integer_equals", "expected": 5},
    }
)
SIZE = 4


class SlowScriptedAgent(ScriptedAgent):
    """The scripted agent, each episode `delay_s` long (a delay, nothing else faked)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__("5")
        self.delay_s = delay_s

    async def run(self, spec):
        await asyncio.sleep(self.delay_s)
        return await super().run(spec)


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


async def _up() -> bool:
    return True


async def _group(redis, delay_s: float) -> tuple[RolloutWorker, TaskStore, asyncio.Task]:
    store = TaskStore(redis)
    await store.submit(TASK)
    admission = Admission(
        redis, PolicyVersionWatcher(redis, poll_s=0.05), replica="r0", max_staleness=5,
        groups_per_step=1, poll_s=0.05,
    )  # fmt: skip
    capacity = Capacity(SIZE)
    worker = RolloutWorker(
        redis, store, TaskPool(redis, store, consumer="r0"), admission,
        SlowScriptedAgent(delay_s), capacity,
        InfraGate({"engine": _up, "sandbox": _up}, poll_s=0.05),
        RolloutConfig(group_size=SIZE, max_attempts=1, retry_backoff_s=0.0),
    )  # fmt: skip
    await capacity.acquire(SIZE)  # as the main loop does before run_group
    ticket = await admission.admit("g-1")
    return worker, store, asyncio.create_task(worker.run_group(TASK, ticket))


async def _episodes(store: TaskStore) -> dict:
    return (await store.describe(TASK.task_id))["episodes"]


async def test_a_finished_group_counts_every_episode_before_run_group_returns(redis):
    _, store, group = await _group(redis, 0.05)
    assert len(await group) == SIZE
    episodes = await _episodes(store)  # no wait: the hand-off waited for the counters
    assert episodes["started"] == episodes["finished"] == SIZE and episodes["in_flight"] == 0


@pytest.mark.parametrize("turns", [0, 1, 3])
async def test_a_group_cancelled_early_leaves_nothing_in_flight(redis, turns):
    _, store, group = await _group(redis, 30.0)
    for _ in range(turns):  # 0: run_group never ran; 1: samples created, none begun
        await asyncio.sleep(0)
    group.cancel()
    with pytest.raises(asyncio.CancelledError):
        await group
    episodes = await _episodes(store)  # run_group's finally waited for the counters
    assert episodes["in_flight"] == 0, episodes
    assert episodes["started"] == (0 if turns == 0 else SIZE)  # 0: run_group never ran
