"""`shellrl status` (issue 22, item 7): exit status 0 only while Redis and every service of the
stack answer; 1 as soon as one is down, naming it. Real redis-server and sandbox processes, and the
real command in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.helpers.processes import REPO
from tests.helpers.redis_server import RedisServer, free_port


def status(state_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "status", "--state-dir", str(state_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
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
