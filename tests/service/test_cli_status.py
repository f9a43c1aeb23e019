"""`shellrl status` (issue 22, item 7): exit status 0 only while Redis and every service of the
stack answer; 1 as soon as one is down, naming it. Real redis-server and sandbox processes, and the
real command in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO
from tests.helpers.redis_server import RedisServer, free_port


def status(state_dir) -> subprocess.CompletedProcess:
    return run_owned(
        [sys.executable, "-m", "cli.main", "status", "--state-dir", str(state_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout_s=60,
    )


def write_stack(state_dir, urls: dict[str, str], redis_url: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "stack.json").write_text(
        json.dumps(
            {
                "launcher_pid": 0,
                "processes": {},
                "urls": urls,
                "redis_url": redis_url,
                "started_at": time.time(),
            }
        )
    )


def test_status_exits_0_while_everything_is_up_and_1_naming_what_went_down(
    tmp_path, sandbox_services
):
    sandbox = sandbox_services.get("bubblewrap")
    redis = RedisServer(tmp_path / "redis").start()
    state = tmp_path / "state"
    try:
        write_stack(state, {"sandbox": sandbox.url}, redis.url)
        up = status(state)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "sandbox:ready" in up.stdout
        redis.stop()
        down = status(state)
        assert down.returncode == 1
        assert down.stderr.strip().splitlines()[-1] == "down: redis"
    finally:
        redis.stop()


def test_status_exits_1_when_every_service_is_down(tmp_path):
    state = tmp_path / "state"
    urls = {
        name: f"http://127.0.0.1:{free_port()}"
        for name in ("engine", "sandbox", "verifier", "rollout")
    }
    write_stack(state, urls, f"redis://127.0.0.1:{free_port()}/0")
    done = status(state)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "down: engine, sandbox, verifier, rollout, redis"


def test_status_exits_1_when_no_stack_runs(tmp_path):
    done = status(tmp_path / "nothing")
    assert done.returncode == 1 and "no stack running" in done.stderr


async def test_status_shows_per_group_the_pending_entries_trimmed_away_before_they_were_handled(
    tmp_path,
):
    """Issue 15, fault 7: the consumers that found them gone (own pending list, XAUTOCLAIM) count
    them in Redis, so `shellrl status` shows them after those processes are gone."""
    from shellrl.contract import Trajectory
    from shellrl.streams import (
        GROUP_LEARNER,
        STREAM_TRAJECTORIES,
        OutgoingEntry,
        StreamConsumer,
        StreamProducer,
        connect,
    )

    redis_server = RedisServer(tmp_path / "redis").start()
    state = tmp_path / "state"
    redis = connect(redis_server.url)
    try:
        owner = StreamConsumer(redis, STREAM_TRAJECTORIES, GROUP_LEARNER, "learner-0")
        stats = StreamConsumer(redis, STREAM_TRAJECTORIES, "rollout-stats", "rollout-0")
        for consumer in (owner, stats):
            await consumer.ensure_group()
        entries = [
            OutgoingEntry(Trajectory(trajectory_id=f"t{i}").SerializeToString()) for i in range(5)
        ]
        await StreamProducer(redis, STREAM_TRAJECTORIES).add_many(entries)
        assert len(await owner.read(count=3, block_ms=0)) == 3
        assert len(await stats.read(count=2, block_ms=0)) == 2
        await redis.xtrim(STREAM_TRAJECTORIES, maxlen=0)  # ignores the groups: a faulty trim
        claimer = StreamConsumer(
            redis, STREAM_TRAJECTORIES, GROUP_LEARNER, "learner-1", claim_min_idle_ms=0
        )
        assert await claimer.claim_idle(10) == []  # XAUTOCLAIM: 3 ids deleted
        stats._recovered = False  # as after a failed read: re-read own pending, 2 ids empty
        assert await stats.read(count=10, block_ms=0) == []
        write_stack(state, {}, redis_server.url)
        shown = run_owned(
            [sys.executable, "-m", "cli.main", "status", "--state-dir", str(state)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout_s=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        (row,) = [line for line in shown.stdout.splitlines() if STREAM_TRAJECTORIES in line]
        assert "lost to trimming: learner 3, rollout-stats 2" in row
        (row,) = [line for line in shown.stdout.splitlines() if "shellrl:episodes" in line]
        assert "lost" not in row
    finally:
        await redis.aclose()
        redis_server.stop()
