"""Crash recovery of the stream layer with real processes: a consumer killed before XACK, and
Redis itself restarted on its AOF directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shellrl.contract import Trajectory
from shellrl.streams import OutgoingEntry, StreamConsumer, StreamProducer, connect
from tests.helpers.owned_processes import popen_owned, run_owned

REPO = Path(__file__).resolve().parents[2]
STREAM, GROUP, EFFECTS = "shellrl:episodes", "verifier", "shellrl:trajectories"


def _trajectories(n: int) -> list[OutgoingEntry]:
    out = []
    for i in range(n):
        tid = f"traj-{i:04d}"
        out.append(
            OutgoingEntry(
                Trajectory(trajectory_id=tid, task_id="t").SerializeToString(),
                tid,
                {"task_id": "t"},
            )
        )
    return out


def _worker(url: str, consumer: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.helpers.stream_worker",
        "--url",
        url,
        "--stream",
        STREAM,
        "--group",
        GROUP,
        "--effects",
        EFFECTS,
        "--consumer",
        consumer,
        *args,
    ]


async def test_consumer_killed_before_ack_has_every_entry_reclaimed_and_handled_exactly_once(
    redis_server, tmp_path
):
    n, effects_before_crash = (
        250,
        100,
    )  # 250 > XAUTOCLAIM COUNT 100: the cursor must be followed (C30)
    redis = connect(redis_server.url)
    setup = StreamConsumer(redis, STREAM, GROUP, "setup")
    await setup.ensure_group()
    await StreamProducer(redis, STREAM).add_many(_trajectories(n))

    ready = tmp_path / "ready.json"
    crashing = popen_owned(
        _worker(
            redis_server.url,
            "verifier-1",
            "--mode",
            "crash",
            "--expect",
            str(n),
            "--effects-before-crash",
            str(effects_before_crash),
            "--ready-file",
            str(ready),
        ),
        cwd=REPO,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert crashing.poll() is None, crashing.stderr.read().decode()
            assert time.monotonic() < deadline, "crashing consumer never read its entries"
            time.sleep(0.05)
        os.kill(crashing.pid, signal.SIGKILL)
    finally:
        if crashing.poll() is None:
            os.kill(crashing.pid, signal.SIGKILL)
        crashing.wait()
        crashing.stderr.close()

    summary = await redis.xpending(STREAM, GROUP)
    assert summary["pending"] == n
    assert [(c["name"], c["pending"]) for c in summary["consumers"]] == [(b"verifier-1", n)]
    assert await redis.xlen(EFFECTS) == effects_before_crash
    # the cleanup job keeps a consumer that still holds pending entries
    assert await setup.delete_idle_consumers(min_idle_ms=0) == []
    assert (await redis.xpending(STREAM, GROUP))["pending"] == n

    drain = run_owned(
        _worker(
            redis_server.url,
            "verifier-2",
            "--mode",
            "drain",
            "--claim-min-idle-ms",
            "300",
            "--count",
            "100",
        ),
        cwd=REPO,
        capture_output=True,
        timeout_s=120,
    )
    assert drain.returncode == 0, drain.stderr.decode()[-3000:]
    stats = json.loads(drain.stdout.decode().splitlines()[-1])
    assert stats == {"handled": n, "duplicates": effects_before_crash}

    effect_ids = [
        Trajectory.FromString(f[b"pb"]).trajectory_id for _, f in await redis.xrange(EFFECTS)
    ]
    assert sorted(effect_ids) == [
        f"traj-{i:04d}" for i in range(n)
    ]  # every entry, each exactly once
    assert (await redis.xpending(STREAM, GROUP))["pending"] == 0
    assert sorted(await setup.delete_idle_consumers(min_idle_ms=0)) == ["verifier-1", "verifier-2"]
    await redis.aclose()


async def test_redis_restart_keeps_acknowledged_and_pending_state(redis_server):
    redis = connect(redis_server.url)
    producer = StreamProducer(redis, STREAM)
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "verifier-1", block_ms=200, count=10, claim_interval_s=3600
    )
    await consumer.ensure_group()
    added = await producer.add_many(_trajectories(20))
    ids = [eid for eid, _ in added]
    first = await consumer.read()
    assert [e.entry_id for e in first] == ids[:10]
    await consumer.ack(*ids[:4])
    groups_before = await redis.xinfo_groups(STREAM)
    await redis.aclose()

    redis_server.restart()  # SIGTERM, then a new redis-server on the same AOF directory and port

    redis = connect(redis_server.url)
    assert await redis.xlen(STREAM) == 20
    groups_after = await redis.xinfo_groups(STREAM)
    assert groups_after[0]["pending"] == 6
    assert groups_after[0]["last-delivered-id"] == groups_before[0]["last-delivered-id"]
    pending = await redis.xpending_range(STREAM, GROUP, min="-", max="+", count=100)
    assert [p["message_id"].decode() for p in pending] == ids[4:10]
    assert {p["consumer"] for p in pending} == {b"verifier-1"}
    # idempotency keys survived too: re-adding the first trajectory appends nothing
    assert await StreamProducer(redis, STREAM).add(b"again", idempotency_key="traj-0000") == (
        ids[0],
        True,
    )

    # the same consumer restarts: its own pending entries first, then the undelivered ones
    restarted = StreamConsumer(
        redis, STREAM, GROUP, "verifier-1", block_ms=200, count=10, claim_interval_s=3600
    )
    own = await restarted.read()
    assert [e.entry_id for e in own] == ids[4:10] and all(e.deliveries == 2 for e in own)
    new = await restarted.read()
    assert [e.entry_id for e in new] == ids[10:]
    await restarted.ack(*(e.entry_id for e in own + new))
    assert await producer_backlog(redis) == 0
    await redis.aclose()


async def producer_backlog(redis) -> int:
    return await StreamProducer(redis, STREAM).backlog(GROUP)
