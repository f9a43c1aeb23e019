"""The long-tail section of benchmarks/bench_rollout.py (its docstring, item 2): the real
scheduler, admission and worker with in-process FAKE engine and sandbox clients where one episode
in every 8th group takes 8x longer, a simulated learner that trains complete groups in completion
order, and each trajectory's staleness at training (`bench_tail`, one mode per call).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from services.rollout import worker as rollout_worker
from services.rollout.admission import Admission
from services.rollout.agent_loop import AgentLoop
from services.rollout.episode_spec import EpisodeLimits
from services.rollout.gates import Capacity, InfraGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from services.rollout.worker import RolloutConfig, RolloutWorker
from shellrl import streams
from shellrl.contract import min_policy_version, parse_trajectory, task_from_json
from shellrl.service.aio import cancel_and_wait
from tests.fakes.fake_engine import DelayedEngine
from tests.fakes.fake_sandbox import FakeSandbox
from tests.helpers.redis_server import RedisServer

# --- 2. long tail ----------------------------------------------------------------------------------


def tail_delays(short_s: float, long_s: float, every: int = 8) -> Callable[[str], float]:
    """Seconds of one request by its rid (`<group_id>-<index>-a<attempt>-t<turn>-r<k>`, group_id
    `g-<hex>`: worker.py, agent_loop.py): `long_s` for sample 0 of every `every`-th group seen,
    `short_s` otherwise."""
    groups: dict[str, int] = {}

    def delay_s(rid: str) -> float:
        prefix, group_hex, index = rid.split("-")[:3]
        ordinal = groups.setdefault(f"{prefix}-{group_hex}", len(groups))
        return long_s if ordinal % every == 0 and index == "0" else short_s

    return delay_s


@dataclass
class TailResult:
    mode: str
    max_staleness: int
    strict: bool
    utilisation: float
    trajectories_per_min: float
    steps: int
    max_staleness_seen: int
    over_bound: int
    trained: int
    staleness: list[int] = field(default_factory=list)


async def _learner(
    redis,
    engine: DelayedEngine,
    group_size: int,
    groups_per_step: int,
    result: TailResult,
    stop: asyncio.Event,
) -> None:
    """Simulated learner: complete groups in completion order, `groups_per_step` per step; staleness
    of each trained trajectory = version at training - its oldest ACTION version."""
    groups: dict[str, list] = {}
    complete: list[list] = []
    last = "0-0"
    while not stop.is_set():
        resp = await redis.xread({streams.STREAM_EPISODES: last}, block=100, count=256)
        for _, entries in resp or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                traj = parse_trajectory(fields[b"pb"])
                members = groups.setdefault(traj.group_id, [])
                members.append(traj)
                if len(members) == group_size:
                    complete.append(groups.pop(traj.group_id))
        while len(complete) >= groups_per_step:
            batch, complete[:] = complete[:groups_per_step], complete[groups_per_step:]
            for group in batch:
                for traj in group:
                    result.staleness.append(engine.version - min_policy_version(traj))
            engine.version += 1
            result.steps += 1
            await redis.set(streams.POLICY_VERSION_KEY, engine.version)
            await redis.publish(streams.POLICY_UPDATES_CHANNEL, str(engine.version))


async def bench_tail(
    mode: str,
    max_staleness: int,
    strict: bool,
    *,
    scale: float,
    window_s: float,
    group_size: int = 8,
    groups: int = 8,
) -> TailResult:
    redis_server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-rollout-tail-"))).start()
    redis = streams.connect(redis_server.url)
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))
    reply = chat.tokenizer("<answer>1</answer>", add_special_tokens=False)["input_ids"]
    engine = DelayedEngine(reply + [chat.end_of_turn_id], tail_delays(10 * scale, 80 * scale))
    store = TaskStore(redis)
    for i in range(16):
        await store.submit(
            task_from_json(
                {
                    "task_id": f"tail-{i}",
                    "instruction": f"task {i}",
                    "check": {"type": "answer_equals", "expected": "1"},
                }
            )
        )
    agent = AgentLoop(engine, FakeSandbox(), chat, EpisodeLimits(max_turns=1))
    watcher = PolicyVersionWatcher(redis, poll_s=0.05)
    admission = Admission(
        redis,
        watcher,
        replica="bench",
        max_staleness=max_staleness,
        groups_per_step=groups,
        strict=strict,
        poll_s=0.05,
    )
    pool = TaskPool(redis, store, consumer="bench")
    worker = RolloutWorker(
        redis,
        store,
        pool,
        admission,
        agent,
        Capacity(groups * group_size),
        InfraGate({}),
        RolloutConfig(group_size=group_size, episodes_backlog_bound=100_000),
    )
    result = TailResult(mode, max_staleness, strict, 0.0, 0.0, 0, 0, 0, 0)
    stop = asyncio.Event()
    background = [
        asyncio.create_task(watcher.run()),
        asyncio.create_task(pool.feed()),
        asyncio.create_task(_learner(redis, engine, group_size, groups, result, stop)),
    ]
    start = time.monotonic()
    stop_admitting = asyncio.Event()
    main = asyncio.create_task(worker.run(stop_admitting))
    await asyncio.sleep(window_s)
    end = time.monotonic()
    stop_admitting.set()
    await cancel_and_wait(main)
    if not engine.busy_s:  # every episode failed before its first request (the log says why)
        raise RuntimeError(f"long tail, {mode}: no episode reached the engine in {window_s:g} s")
    finished = sum(1 for s, e in engine.busy_s if e <= end)
    busy = sum(max(0.0, min(e, end) - max(s, start)) for s, e in engine.busy_s)
    await worker.drain(0.0)
    if rollout_worker._BOOKKEEPING:  # the cancelled groups' hand-offs, finishing in the background
        await asyncio.wait(set(rollout_worker._BOOKKEEPING), timeout=10)
    stop.set()
    await cancel_and_wait(*background)
    await redis.aclose()
    redis_server.stop()
    result.utilisation = busy / (groups * group_size * (end - start))
    result.trajectories_per_min = 60 * finished / (end - start)
    result.trained = len(result.staleness)
    result.max_staleness_seen = max(result.staleness, default=0)
    result.over_bound = sum(s > max_staleness for s in result.staleness)
    return result
