"""One seed, one run: the rollout worker's whole path (task pool, admission, agent loop against the
real tiny engine and a real sandbox) run twice from a fresh Redis with one seed samples the same
tokens; another seed samples others. No learner runs, so both runs hold the same weights (with a
learner, a weight update lands at a time-dependent point of an episode: services/rollout/seeding.py).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from services.rollout.admission import Admission
from services.rollout.episode_spec import EpisodeSpec, Sampling
from services.rollout.gates import Capacity, InfraGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.seeding import eval_episode_seed
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from services.rollout.worker import RolloutConfig, RolloutWorker
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox import SandboxClient
from shellrl.contract import SegmentKind, Trajectory
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import STREAM_EPISODES, connect
from tests.helpers.waiting import wait_until_async
from tests.service.rollout.conftest import make_agent, make_task

TASKS = [
    make_task(task_id="t-lines"),
    make_task("Print the first line of numbers.txt.", task_id="t-head"),
]
GROUP_SIZE = 3
SAMPLING = Sampling(temperature=1.0, max_new_tokens=10)


async def sample_run(redis_url: str, engine_url: str, sandbox_url: str, chat, seed: int) -> dict:
    """One run: a fresh Redis db, both tasks submitted, the worker until every task's first group
    was published. Returns {(task_id, sample index): action token bytes} of those groups."""
    redis = connect(redis_url)
    await redis.flushdb()
    store = TaskStore(redis)
    for task in TASKS:
        await store.submit(task)
    pool = TaskPool(redis, store, consumer="rollout-0", seed=seed)
    admission = Admission(
        redis, PolicyVersionWatcher(redis), replica="rollout-0", max_staleness=0, groups_per_step=2
    )  # two groups, then admission waits for a learner that never comes: one epoch
    async with EngineClient(engine_url) as engine, SandboxClient(sandbox_url) as sandbox:
        worker = RolloutWorker(
            redis,
            store,
            pool,
            admission,
            make_agent(engine, sandbox, chat, max_turns=2),
            Capacity(2 * GROUP_SIZE),
            InfraGate({"engine": _up, "sandbox": _up}),
            RolloutConfig(group_size=GROUP_SIZE, sampling=SAMPLING, sampling_seed=seed),
        )
        stop = asyncio.Event()
        tasks = [asyncio.create_task(pool.feed(stop)), asyncio.create_task(worker.run(stop))]
        try:
            await wait_until_async(
                lambda: _xlen_at_least(redis, 2 * GROUP_SIZE), timeout_s=240, what="two groups"
            )
        finally:
            stop.set()
            await cancel_and_wait(*tasks)
            await worker.drain(5.0)
        out = {}
        for _, fields in await redis.xrange(STREAM_EPISODES):
            traj = Trajectory()
            traj.ParseFromString(fields[b"pb"])
            out[(traj.task_id, int(traj.trajectory_id.split("-")[-2]))] = action_tokens(traj)
            if traj.sandbox_session_id:  # kept for a verifier that does not run here
                await sandbox.delete(traj.sandbox_session_id)
    await redis.aclose()
    return out


def action_tokens(traj: Trajectory) -> bytes:
    return b"".join(s.token_ids for s in traj.segments if s.kind == SegmentKind.SEGMENT_KIND_ACTION)


async def test_two_runs_with_one_seed_sample_the_same_tokens_and_another_seed_others(
    module_redis_server, engine_process, sandbox_process, chat
):
    urls = (module_redis_server.url, engine_process.url, sandbox_process.url)
    first = await sample_run(*urls, chat, seed=11)
    again = await sample_run(*urls, chat, seed=11)
    other = await sample_run(*urls, chat, seed=12)
    assert len(first) == 2 * GROUP_SIZE and all(first.values())
    assert first == again
    assert sum(first[k] != other.get(k) for k in first) >= GROUP_SIZE  # most samples differ
    samples = defaultdict(set)
    for (task_id, _), tokens in first.items():
        samples[task_id].add(tokens)
    assert all(len(s) > 1 for s in samples.values())  # a group's samples differ from each other


async def test_an_eval_episode_with_a_seed_repeats_itself(engine_process, sandbox_process, chat):
    seed = eval_episode_seed(5, "t-lines", 0)
    async with (
        EngineClient(engine_process.url) as engine,
        SandboxClient(sandbox_process.url) as sandbox,
    ):
        agent = make_agent(engine, sandbox, chat, max_turns=2)
        runs = [
            await agent.run(
                EpisodeSpec(TASKS[0], f"e-{k}", eval=True, sampling=SAMPLING, seed=seed)
            )
            for k in range(2)
        ]
    assert action_tokens(runs[0]) == action_tokens(runs[1]) != b""


async def _up() -> bool:
    return True


async def _xlen_at_least(redis, n: int) -> bool:
    return int(await redis.xlen(STREAM_EPISODES)) >= n
