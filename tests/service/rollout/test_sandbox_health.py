"""The rollout gateway reads the sandbox's terminal health score (real processes: Redis, sandbox,
gateway with its worker off) and says in /v1/status whether new groups are slowed; the gate's
delay itself is in tests/unit/test_reward_components.py."""

from __future__ import annotations

import httpx
import pytest

from services.rollout.health_gate import HealthGate
from shellrl.clients.sandbox import SandboxClient
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port


@pytest.fixture
def gateway(redis_server, sandbox_process, tmp_path):
    proc = ServiceProcess(
        "rollout",
        free_port(),
        {
            "SHELLRL_REDIS_URL": redis_server.url,
            "SHELLRL_ENGINE_URLS": "http://127.0.0.1:9",
            "SHELLRL_SANDBOX_URL": sandbox_process.url,
            "SHELLRL_VERIFIER_URL": "http://127.0.0.1:9",
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_WORKER_ENABLED": "false",
            "SHELLRL_SANDBOX_HEALTH_THRESHOLD": "1.0",  # any real host scores below 1
        },
        tmp_path,
    ).start(120)
    yield proc
    proc.stop()


def test_status_says_new_groups_are_slowed_below_the_health_threshold(gateway):
    status = httpx.get(f"{gateway.url}/v1/status", timeout=30).json()
    health = status["sandbox_health"]
    assert 0.0 <= health["score"] < 1.0
    assert health["threshold"] == 1.0 and health["below_threshold"] is True
    assert health["delay_s"] == 2.0 and health["groups_delayed"] == 0  # no worker here


async def test_the_gate_reads_a_real_sandbox_score(sandbox_process):
    async with SandboxClient(sandbox_process.url) as sandbox:
        healthy = HealthGate(sandbox.ready, threshold=0.01, delay_s=5)
        await healthy.wait()  # a host this test runs on scores above 0.01: no delay
        assert not healthy.slowed and 0.01 <= healthy.score <= 1.0
        starved = HealthGate(sandbox.ready, threshold=1.0, delay_s=0.01)
        await starved.wait()
        assert starved.slowed and starved.groups_delayed == 1
