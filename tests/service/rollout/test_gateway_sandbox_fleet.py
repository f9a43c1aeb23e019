"""The rollout gateway and the verifier over two real sandbox services (issue 18 item 3):
`SHELLRL_SANDBOX_URL` lists both; episodes' sessions land on both, the verifier's checks reach
each session's owner (a misrouted check would be an INFRA failure), and /v1/status and /metrics
show the sandbox fleet."""

from __future__ import annotations

import shutil

import httpx
import redis as sync_redis

from shellrl.contract import Failure, parse_trajectory
from shellrl.streams import STREAM_TRAJECTORIES
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until
from tests.service.rollout.conftest import start_sandbox

GROUP_SIZE = 4
TASK = {
    "task_id": "fleet-lines",
    "instruction": "How many lines does numbers.txt have?",
    "setup": "seq 1 5 > numbers.txt",
    "check": [
        {"type": "file_exists", "path": "numbers.txt"},
        {"type": "command_output_equals", "command": "wc -l < numbers.txt", "expected": "5"},
    ],
    "source": "test",
}


def sessions_created(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    line = 'shellrl_sandbox_sessions_created_total{outcome="ok"}'
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))


def test_episodes_use_both_sandboxes_and_the_verifier_checks_each_in_its_owner(
    redis_server, engine_process, tmp_path
):
    started, roots = [], []
    try:
        for _ in range(2):
            sandbox, root = start_sandbox(tmp_path)
            started.append(sandbox)
            roots.append(root)
        urls = ",".join(s.url for s in started)
        env = {"SHELLRL_REDIS_URL": redis_server.url, "SHELLRL_SANDBOX_URL": urls}
        verifier = ServiceProcess("verifier", free_port(), env, tmp_path).start(120)
        started.append(verifier)
        gateway = ServiceProcess(
            "rollout",
            free_port(),
            {
                **env,
                "SHELLRL_ENGINE_URLS": engine_process.url,
                "SHELLRL_VERIFIER_URL": verifier.url,
                "SHELLRL_MODEL_PATH": "tiny",
                "SHELLRL_GROUP_SIZE": str(GROUP_SIZE),
                "SHELLRL_GROUPS_PER_STEP": "1",
                "SHELLRL_MAX_STALENESS": "0",
                "SHELLRL_MAX_TURNS": "1",
                "SHELLRL_MAX_NEW_TOKENS": "4",
                "SHELLRL_SHUTDOWN_GRACE_S": "3",
            },
            tmp_path,
        ).start(120)
        started.append(gateway)
        http = httpx.Client(base_url=gateway.url, timeout=30)
        assert http.post("/v1/tasks", json=TASK).status_code == 201
        redis = sync_redis.Redis.from_url(redis_server.url)
        scored = wait_until(
            lambda: (
                len(t := [parse_trajectory(f[b"pb"]) for _, f in redis.xrange(STREAM_TRAJECTORIES)])
                >= GROUP_SIZE
                and t
            ),
            120,
            "the group's scored trajectories",
        )
        status = http.get("/v1/status").json()["sandboxes"]
        metrics = http.get("/metrics").text
        per_sandbox = [sessions_created(s.url) for s in started[:2]]
    finally:
        for proc in reversed(started):
            proc.stop()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    assert [t.failure for t in scored] == [Failure.FAILURE_NONE] * GROUP_SIZE
    assert all(t.scored for t in scored)  # a misrouted check would be an INFRA failure
    assert all(n >= 1 for n in per_sandbox)  # sessions landed on both
    assert [m["url"] for m in status["members"]] == urls.split(",")
    assert sum(m["created"] for m in status["members"]) >= GROUP_SIZE
    assert "shellrl_rollout_sandbox_waiting_episodes 0.0" in metrics
