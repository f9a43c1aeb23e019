"""A rollout replica killed with work in flight, on a real Redis (issue 15, items 5 and 6).

Replica A takes 3 tasks of a 5-task epoch (2 groups admitted and running, 1 waiting for
admission) and is killed: its Redis client goes dead before its tasks are cancelled, so none of
its clean-up reaches Redis (as after SIGKILL). Then a replica with the same name restarts (item 5),
or one with another name takes over once A's heartbeat is older than the bound (item 6). Either
way every task of the epoch runs exactly once, as without the kill, and admission is reconciled.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError

from services.rollout.admission import Admission
from services.rollout.gates import Capacity, InfraGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.replicas import Replicas
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from services.rollout.worker import RolloutConfig, RolloutWorker
from shellrl.contract import task_from_json
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import GROUP_ROLLOUT, POLICY_VERSION_KEY, STREAM_TASKS, connect
from shellrl.streams.keys import ADMITTED_KEY, INFLIGHT_KEY, REPLICAS_KEY, taken_key
from tests.fakes.scripted_agent import ScriptedAgent
from tests.helpers.waiting import wait_until_async

TASKS = [f"t{i}" for i in range(5)]
GROUP_SIZE = 2


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


class Agent(ScriptedAgent):
    """Canned episodes; with `hold`, every episode waits for it (a replica's groups in flight)."""

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        super().__init__("5")
        self.hold, self.tasks = hold, []

    async def run(self, spec):
        self.tasks.append(spec.task.task_id)
        if self.hold is not None:
            await self.hold.wait()
        return await super().run(spec)


class Replica:
    """One gateway replica's worker loop (the parts app.py builds), taking from a shared pool."""

    def __init__(self, redis, name: str, agent: Agent, *, max_staleness: int) -> None:
        self.redis, self.agent, self.stop = redis, agent, asyncio.Event()
        store = TaskStore(redis)
        self.pool = TaskPool(redis, store, consumer=name, seed=3)
        self.taken: list[tuple[int, str]] = []  # (epoch, task id) in the order the pool gave them
        next_task = self.pool.next_task

        async def recorded(poll_s: float = 1.0):
            pooled = await next_task(0.05)
            self.taken.append((pooled.epoch, pooled.task.task_id))
            if pooled.epoch >= 1:  # the first task of epoch 1 is this replica's last group
                self.stop.set()
            return pooled

        self.pool.next_task = recorded
        watcher = PolicyVersionWatcher(redis, poll_s=0.05)
        self.admission = Admission(
            redis,
            watcher,
            replica=name,
            max_staleness=max_staleness,
            groups_per_step=2,
            poll_s=0.05,
        )
        gate = InfraGate({"engine": _up, "sandbox": _up}, poll_s=0.05)
        self.worker = RolloutWorker(
            redis,
            store,
            self.pool,
            self.admission,
            agent,
            Capacity(100),
            gate,
            RolloutConfig(group_size=GROUP_SIZE, max_attempts=1),
        )
        self.main: asyncio.Task | None = None

    def start(self) -> Replica:
        self.main = asyncio.create_task(self.worker.run(self.stop))
        return self

    def epoch_tasks(self, epoch: int) -> list[str]:
        return [task_id for e, task_id in self.taken if e == epoch]

    async def kill(self) -> None:
        """SIGKILL: the client dies first, so no clean-up (give-back, put-back) reaches Redis."""

        async def dead(*args, **kwargs):
            raise ConnectionError("replica killed")

        self.redis.execute_command = dead  # every command and script goes through it
        self.stop.set()
        await cancel_and_wait(self.main, *self.worker._groups)

    async def run_until_epoch_one(self) -> None:
        await asyncio.wait_for(self.main, 20)  # it stops after the first task of epoch 1
        await self.worker.drain(20.0)


async def _up() -> bool:
    return True


async def fill_pool(redis) -> None:
    store = TaskStore(redis)
    for task_id in TASKS:
        await store.submit(
            task_from_json(
                {
                    "task_id": task_id,
                    "instruction": "Say 5.",
                    "check": {"type": "answer_integer_equals", "expected": 5},
                }
            )
        )
    pool = TaskPool(redis, store, consumer="feeder")
    feeder = asyncio.create_task(pool.feed())
    await wait_until_async(lambda: _equals(pool.size(), len(TASKS)), 10, "the pool to fill")
    await cancel_and_wait(feeder)


async def _equals(awaitable, value) -> bool:
    return await awaitable == value


async def start_and_kill(redis_server, name: str, *, heartbeat: bool = False) -> Replica:
    """Replica `name` takes 3 tasks: 2 groups admitted (bound (0 + 1) * 2) and held, 1 waiting.
    With `heartbeat`, it beats every 0.2 s until killed."""
    a = Replica(connect(redis_server.url), name, Agent(hold=asyncio.Event()), max_staleness=0)
    if heartbeat:
        beats = Replicas(
            a.redis, a.pool, a.admission, [], name=name, heartbeat_s=0.2, dead_after_s=1.0
        )
        a.worker._groups.add(asyncio.create_task(beats.run(a.stop)))  # killed with the rest
    a.start()
    await wait_until_async(
        lambda: len(a.taken) == 3 and len(a.agent.tasks) == 2 * GROUP_SIZE,
        10,
        "replica A to take 3 tasks and run 2 groups",
    )
    await asyncio.sleep(0.2)  # the third is waiting for admission
    await a.kill()
    return a


def ran_once_each(b: Replica) -> bool:
    """B ran every task of epoch 0 exactly once (a group of GROUP_SIZE episodes), and the one
    task of epoch 1 it took before it stopped."""
    assert sorted(b.epoch_tasks(0)) == TASKS and len(b.epoch_tasks(1)) == 1
    expected = sorted((TASKS + b.epoch_tasks(1)) * GROUP_SIZE)
    return sorted(b.agent.tasks) == expected


async def test_a_replica_killed_with_tasks_taken_runs_them_after_its_restart(redis_server, redis):
    await fill_pool(redis)
    a = await start_and_kill(redis_server, "rollout-0")
    assert await redis.llen(taken_key("rollout-0")) == 3 and await redis.zcard(INFLIGHT_KEY) == 2
    await redis.set(POLICY_VERSION_KEY, 10)  # the learner moves on: admission is not the limit
    b = Replica(redis, "rollout-0", Agent(), max_staleness=0).start()  # the restart, same name
    await b.run_until_epoch_one()
    assert b.epoch_tasks(0)[:3] == a.epoch_tasks(0)  # A's tasks first, in the order A took them
    assert ran_once_each(b)  # every task of the epoch exactly once
    assert await redis.llen(taken_key("rollout-0")) == 0 and await redis.zcard(INFLIGHT_KEY) == 0
    assert int(await redis.get(ADMITTED_KEY)) == len(b.taken)  # A's 2 groups were given back


async def test_a_dead_replica_s_work_is_taken_over_by_another_within_the_bound(redis_server, redis):
    """Bound: A's tasks and admission are back within dead_after_s + heartbeat_s (1.0 + 0.2 s)
    of its last heartbeat; its consumer leaves the group once it holds no pending entries."""
    await fill_pool(redis)
    await redis.xgroup_createconsumer(STREAM_TASKS, GROUP_ROLLOUT, "rollout-a")  # A's feeder
    b = Replica(redis, "rollout-b", Agent(), max_staleness=0)
    monitor = Replicas(
        redis,
        b.pool,
        b.admission,
        [b.pool.consumer],
        name="rollout-b",
        heartbeat_s=0.2,
        dead_after_s=1.0,
    )
    a = await start_and_kill(redis_server, "rollout-a", heartbeat=True)
    assert await redis.llen(taken_key("rollout-a")) == 3 and await redis.zcard(INFLIGHT_KEY) == 2
    last_beat = float(await redis.zscore(REPLICAS_KEY, "rollout-a"))
    await redis.set(POLICY_VERSION_KEY, 10)
    watch = asyncio.create_task(monitor.run(asyncio.Event()))  # B's heartbeat, already running
    await wait_until_async(  # the take-over recovers the tasks, then the admission: two calls
        lambda: _taken_over(redis, "rollout-a"),
        5,
        "A's taken tasks back in the order and its admission given back",
    )
    # the bound, plus slack for a loaded 2-core machine (1.7 s failed there under load): what is
    # checked is a take-over bounded by the heartbeat settings, not one that waits for a restart
    assert time.time() - last_beat < 1.0 + 0.2 + 3.0
    b.start()
    await b.run_until_epoch_one()
    assert b.epoch_tasks(0)[:3] == a.epoch_tasks(0) and ran_once_each(b)
    await wait_until_async(
        lambda: _equals(redis.zscore(REPLICAS_KEY, "rollout-a"), None),
        5,
        "A's consumer to leave the group and its name the heartbeat set",
    )
    await cancel_and_wait(watch)
    consumers = {c["name"] for c in await redis.xinfo_consumers(STREAM_TASKS, GROUP_ROLLOUT)}
    assert b"rollout-a" not in consumers and "rollout-a" not in consumers
    assert await redis.zscore(REPLICAS_KEY, "rollout-a") is None
    assert await redis.llen(taken_key("rollout-b")) == 0 and await redis.zcard(INFLIGHT_KEY) == 0
    assert int(await redis.get(ADMITTED_KEY)) == len(b.taken)  # A's 2 groups were given back


async def _no_member(redis, prefix: str) -> bool:
    return not [m for m in await redis.zrange(INFLIGHT_KEY, 0, -1) if m.decode().startswith(prefix)]


async def _taken_over(redis, replica: str) -> bool:
    return await redis.llen(taken_key(replica)) == 0 and await _no_member(redis, f"{replica}|")
