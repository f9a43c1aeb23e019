"""The learner as a real process against real Redis and a real engine process (tiny model).

Trajectories are sampled from the engine (real behavior log-probs and versions) and added to
shellrl:trajectories as the verifier would (idempotent by trajectory_id).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from services.learner.allocator import jemalloc_path
from services.learner.checkpoint import surviving_steps
from shellrl import streams
from shellrl.clients.engine import EngineClient
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.trajectories import sample_group
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.slow
PROMPT = [1, 9690, 28, 253, 1061, 30]
ENGINE_ENV = {"SHELLRL_MODEL_PATH": "tiny", "SHELLRL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    proc = ServiceProcess("engine", free_port(), ENGINE_ENV, tmp_path_factory.mktemp("engine"))
    proc.start(ready_timeout_s=180)
    yield proc
    proc.stop()


def learner_env(redis_url: str, engine_url: str, tmp: Path, **extra) -> dict[str, str]:
    env = {
        "SHELLRL_MODEL_PATH": "tiny",
        "SHELLRL_ENGINE_URLS": engine_url,
        "SHELLRL_REDIS_URL": redis_url,
        "SHELLRL_CHECKPOINT_DIR": str(tmp / "ckpt"),
        "SHELLRL_WEIGHT_SYNC_DIR": str(tmp / "sync"),
        "SHELLRL_GROUPS_PER_STEP": "1",
        "SHELLRL_CHECKPOINT_INTERVAL_STEPS": "2",
        "SHELLRL_MAX_STALENESS": "100",
        "SHELLRL_GROUP_TIMEOUT_S": "60",
        "SHELLRL_BLOCK_MS": "200",
        "SHELLRL_PAD_TO_MULTIPLE_OF": "8",
        "SHELLRL_WEIGHT_SYNC_TIMEOUT_S": "10",
        "SHELLRL_ENGINE_RETRY_INTERVAL_S": "1",
        "SHELLRL_NUM_THREADS": "1",
    }
    return env | {f"SHELLRL_{k.upper()}": str(v) for k, v in extra.items()}


async def add_group(
    redis, client: EngineClient, group_id: str, n: int = 4, upto: int | None = None
) -> list[str]:
    trajs = await sample_group(client, PROMPT, group_id, n, temperature=0.8, max_new_tokens=4)
    producer = streams.StreamProducer(redis, streams.STREAM_TRAJECTORIES)
    for t in trajs[:upto]:
        await producer.add(
            t.SerializeToString(), idempotency_key=t.trajectory_id, group_id=group_id
        )
    return [t.trajectory_id for t in trajs]


async def add_trajectories(redis, trajs) -> None:
    producer = streams.StreamProducer(redis, streams.STREAM_TRAJECTORIES)
    for t in trajs:
        await producer.add(
            t.SerializeToString(), idempotency_key=t.trajectory_id, group_id=t.group_id
        )


async def http(learner: ServiceProcess, method: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.request(method, learner.url + path)


def status(learner: ServiceProcess, timeout_s: float = 5.0) -> dict:
    return httpx.get(f"{learner.url}/v1/status", timeout=timeout_s).json()


async def step_reaches(learner: ServiceProcess, step: int, timeout_s: float = 90.0) -> dict:
    async def check():
        s = await asyncio.to_thread(status, learner)
        return s if s["step"] >= step else None

    return await wait_until_async(check, timeout_s, f"learner step {step}")


async def test_learner_trains_from_the_stream_pushes_weights_and_publishes_versions(
    engine, redis_server, tmp_path
):
    redis = streams.connect(redis_server.url)
    client = EngineClient([engine.url], timeout_s=120)
    learner = ServiceProcess(
        "learner", free_port(), learner_env(redis_server.url, engine.url, tmp_path), tmp_path
    )
    try:
        learner.start(ready_timeout_s=120)
        await wait_until_async(
            lambda: redis.get(streams.POLICY_VERSION_KEY), 30, "initial version published"
        )
        assert (await redis.get(streams.POLICY_VERSION_KEY)) == b"0"
        if jemalloc_path():  # the process re-executed itself on jemalloc, keeping its pid
            assert "jemalloc" in Path(f"/proc/{learner.proc.pid}/maps").read_text()

        ids = await add_group(redis, client, "g1")
        first = await step_reaches(learner, 1)
        assert (
            first["last_step"]["parity_tokens"] == 16
        )  # sampled by version 0, trained at version 0
        assert (
            first["last_step"]["parity_max"] <= 1e-4
        )  # unchanged weights: learner == engine log-probs

        paused = (await http(learner, "POST", "/v1/pause?wait=true")).json()
        assert paused == {"paused": True, "step": 1}
        assert (await client.get_weight_version()) == {
            engine.url: "1"
        }  # the push of step 1 is done too
        ids += await add_group(redis, client, "g2")
        await asyncio.sleep(1.5)
        assert status(learner)["step"] == 1 and status(learner)["paused"]
        await http(learner, "POST", "/v1/resume")
        s = await step_reaches(learner, 2)
        # g2 was sampled by the pushed version 1 and trained at version 1: the push carried exact weights
        assert s["last_step"]["parity_tokens"] == 16 and s["last_step"]["parity_max"] <= 1e-4

        async def published():  # the step is reported before its push confirms
            return (await redis.get(streams.POLICY_VERSION_KEY)) == b"2"

        await wait_until_async(published, 30, "version 2 published")
        assert (await client.get_weight_version()) == {engine.url: "2"}
        s = status(learner)
        engines = s["weight_sync"]["engines"]
        assert engines[0]["in_rotation"] and engines[0]["version"] == "2"
        # checkpoint at step 2, then everything acknowledged
        await wait_until_async(
            lambda: _no_pending(redis), 30, "entries acknowledged after the checkpoint"
        )
        ledger = [
            json.loads(x) for x in (tmp_path / "ckpt" / "steps.jsonl").read_text().splitlines()
        ]
        assert sorted(
            i for r in ledger if "trajectory_ids" in r for i in r["trajectory_ids"]
        ) == sorted(ids)

        created = await http(learner, "POST", "/v1/checkpoints")
        assert created.status_code == 201 and created.json()["step"] == 2
        text = (await http(learner, "GET", "/metrics")).text
        assert 'shellrl_weight_sync_seconds_count{phase="transfer"}' in text
        assert "shellrl_policy_version 2.0" in text and "shellrl_logprob_diff" in text
        assert 'shellrl_stream_pending{group="learner",stream="shellrl:trajectories"}' in text
        assert (
            'shellrl_trajectories_dropped_total{reason="stale"}' in text
        )  # initialised at start-up
    finally:
        learner.stop()
        await client.close()
        await redis.aclose()


async def test_learner_resumed_until_a_version_pauses_itself_there_with_groups_left_over(
    engine, redis_server, tmp_path
):
    """A training run's last step (issue 34): `POST /v1/resume?until_version=1` with two groups
    waiting trains one step and pauses at version 1 by itself, the second group untrained (a
    run that is `done` at its target never trains one step more); a plain resume goes on at
    SHELLRL_MAX_STEPS (0 here: no limit)."""
    redis = streams.connect(redis_server.url)
    client = EngineClient([engine.url], timeout_s=120)
    env = learner_env(redis_server.url, engine.url, tmp_path, start_paused="true")
    learner = ServiceProcess("learner", free_port(), env, tmp_path)
    try:
        learner.start(ready_timeout_s=120)
        await add_group(redis, client, "first")
        await add_group(redis, client, "second")
        resumed = (await http(learner, "POST", "/v1/resume?until_version=1")).json()
        assert resumed == {"paused": False, "step": 0, "step_target": 1}

        async def paused_by_itself():
            s = await asyncio.to_thread(status, learner)
            return s if s["paused"] else None

        s = await wait_until_async(paused_by_itself, 90, "the learner to pause at version 1")
        assert s["step"] == 1 and s["step_target"] == 1 and s["trajectories_trained"] == 4
        paused = (await http(learner, "POST", "/v1/pause?wait=true")).json()
        assert paused == {"paused": True, "step": 1}  # idle: no step in progress past 1
        assert status(learner)["trajectories_trained"] == 4
        assert (await http(learner, "POST", "/v1/resume?until_version=-1")).status_code == 422
        resumed = (await http(learner, "POST", "/v1/resume")).json()
        assert resumed["step_target"] == 0
        s = await step_reaches(learner, 2)
        assert s["trajectories_trained"] == 8
    finally:
        learner.stop()
        await client.close()
        await redis.aclose()


async def _pending_count(redis) -> int:
    info = await redis.xpending(streams.STREAM_TRAJECTORIES, streams.GROUP_LEARNER)
    return int(info["pending"])


async def _no_pending(redis) -> bool:
    return await _pending_count(redis) == 0


async def test_weight_sync_reports_a_frozen_or_killed_engine_within_the_deadline_and_the_learner_continues(
    redis_server, tmp_path
):
    engine = ServiceProcess("engine", free_port(), ENGINE_ENV, tmp_path)
    engine.start(ready_timeout_s=180)
    redis = streams.connect(redis_server.url)
    client = EngineClient([engine.url], timeout_s=120)
    deadline_s = 3.0
    env = learner_env(redis_server.url, engine.url, tmp_path, weight_sync_timeout_s=deadline_s)
    learner = ServiceProcess("learner", free_port(), env, tmp_path)
    try:
        groups = [await sample_group(client, PROMPT, f"g{i}", 4, temperature=0.8) for i in range(3)]
        learner.start(ready_timeout_s=120)
        await wait_until_async(
            lambda: redis.get(streams.POLICY_VERSION_KEY), 30, "initial version published"
        )

        engine.signal(signal.SIGSTOP)  # frozen: accepts connections, never answers
        added = time.monotonic()
        await add_trajectories(redis, groups[0])

        async def reported():
            e = (await asyncio.to_thread(status, learner, 2.0))["weight_sync"]["engines"][0]
            return e if not e["in_rotation"] else None

        e = await wait_until_async(reported, 90, "frozen engine reported")  # without it: a hang
        assert time.monotonic() - added < deadline_s + 30  # a training step plus the deadline
        assert e["last_error"].startswith("deadline") and e["version"] == "0"
        await add_trajectories(redis, groups[1])
        await step_reaches(learner, 2, timeout_s=30)  # the learner continues without its engine
        assert (
            await redis.get(streams.POLICY_VERSION_KEY)
        ) == b"0"  # nothing confirmed: not published

        engine.signal(signal.SIGCONT)  # it answers again: brought back with a full update

        async def back():
            return (await redis.get(streams.POLICY_VERSION_KEY)) == b"2"

        await wait_until_async(back, 30, "version 2 published after the engine came back")
        assert (await client.get_weight_version()) == {engine.url: "2"}
        assert status(learner)["weight_sync"]["engines"][0]["in_rotation"]

        engine.kill()  # dead: connection refused, reported at once
        await add_trajectories(redis, groups[2])
        e = await wait_until_async(reported, 30, "killed engine reported")
        assert "EngineUnavailable" in e["last_error"]
        assert (await asyncio.to_thread(status, learner))["step"] == 3
        assert (await redis.get(streams.POLICY_VERSION_KEY)) == b"2"
        text = (await http(learner, "GET", "/metrics")).text
        assert 'shellrl_weight_sync_failures_total{reason="deadline"} 1.0' in text
        assert 'shellrl_weight_sync_failures_total{reason="error"} 1.0' in text
    finally:
        engine.signal(signal.SIGCONT)
        learner.stop()
        engine.stop()
        await client.close()
        await redis.aclose()


async def test_learner_killed_between_checkpoints_resumes_without_training_a_trajectory_twice_or_losing_one(
    engine, redis_server, tmp_path
):
    redis = streams.connect(redis_server.url)
    client = EngineClient([engine.url], timeout_s=120)
    env = learner_env(redis_server.url, engine.url, tmp_path, lr=1e-3, warmup_steps=10)
    learner = ServiceProcess("learner", free_port(), env, tmp_path)
    try:
        groups = [
            await sample_group(client, PROMPT, f"g{i}", 4, temperature=0.8) for i in range(1, 5)
        ]
        learner.start(ready_timeout_s=120)
        for step, group in enumerate(groups[:3], start=1):
            await add_trajectories(redis, group)
            await step_reaches(learner, step)
        await add_trajectories(redis, groups[3][:2])  # half a group waits in the assembler
        await wait_until_async(lambda: _assembling(learner, 2), 30, "half group read")
        learner.kill()  # SIGKILL after step 3: the last checkpoint is step 2

        assert (
            await _pending_count(redis) == 6
        )  # step 3's group and the half group: never acknowledged
        # restarted paused, as `shellrl run` starts it: the re-read group of step 3 would
        # otherwise train (and push 3) between ready and the check below, on a loaded machine
        learner.env["SHELLRL_START_PAUSED"] = "true"
        learner.start(ready_timeout_s=120)
        # ready only once the resumed weights reached the engine: step 2's, not the killed
        # learner's step 3 (a before-evaluation started at ready must see the resumed policy)
        assert (await client.get_weight_version()) == {engine.url: "2"}
        assert (await http(learner, "POST", "/v1/resume")).status_code == 200
        resumed = await step_reaches(learner, 3)
        assert resumed["last_step"]["lr"] == pytest.approx(
            3e-4
        )  # not 1e-4 (warmup restarted), not 4e-4
        await add_trajectories(redis, groups[3][2:])
        await step_reaches(learner, 4)
        await wait_until_async(
            lambda: _no_pending(redis), 30, "all entries acknowledged after the step-4 checkpoint"
        )
        assert (await redis.get(streams.POLICY_VERSION_KEY)) == b"4"
        assert (await client.get_weight_version()) == {engine.url: "4"}

        ledger = [
            json.loads(x) for x in (tmp_path / "ckpt" / "steps.jsonl").read_text().splitlines()
        ]
        assert {"event": "resume", "step": 2, "checkpoint": "step-000002"} in ledger
        steps = surviving_steps(ledger)
        assert sorted(steps) == [1, 2, 3, 4]
        trained = [i for s in steps.values() for i in s["trajectory_ids"]]
        everything = sorted(t.trajectory_id for g in groups for t in g)
        assert sorted(trained) == everything  # none lost, none twice
        assert [steps[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4])
    finally:
        learner.stop()
        await client.close()
        await redis.aclose()


async def _assembling(learner: ServiceProcess, n: int) -> bool:
    return (await asyncio.to_thread(status, learner))["pending_trajectories"] == n
