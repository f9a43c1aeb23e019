"""The terminal reward components against real parts: the safety escalation in a real Redis
(restarts included), the workspace diff and the executed-argv trace of a real sandbox, the
verifier computing safety / state_drift / time_efficiency over them, and the sandbox's health
score in /readyz and /metrics."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from services.verifier.parts import build_verifier
from services.verifier.safety_escalation import SafetyEscalation
from services.verifier.settings import VerifierSettings
from shellrl.clients.sandbox import SandboxClient, SandboxNotFound
from shellrl.contract import ToolEvent, task_from_json
from shellrl.streams.keys import safety_escalation_key
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port


@pytest.fixture
async def redis(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_safety_escalates_after_100_clean_steps_and_falls_back_after_one_violation(redis):
    esc = SafetyEscalation(redis, "run-a")
    assert (await esc.apply(3, ["rm_recursive_or_force"], "t0")).penalty == -5.0
    for i in range(10):  # 10 clean episodes of 10 commands: 100 steps without a violation
        assert (await esc.apply(10, [], f"c{i}")).penalty == 0.0
    assert (await esc.state())["next_penalty"] == -8.0
    hit = await esc.apply(2, ["find_delete"], "t1", "task-9")
    assert (hit.penalty, hit.streak_before, hit.escalated) == (-8.0, 100, True)
    assert (await esc.apply(1, ["find_delete"], "t2")).penalty == -5.0  # back to -5
    logged = await esc.violations()
    assert [v["trajectory_id"] for v in logged] == ["t2", "t1", "t0"]
    assert logged[1]["rules"] == ["find_delete"] and logged[1]["task_id"] == "task-9"
    other = SafetyEscalation(redis, "run-b")  # state is per run
    assert (await other.state())["violations"] == 0


async def test_safety_state_survives_a_restart_and_a_redelivery_is_not_counted_twice(
    redis_server,
):
    first = aioredis.Redis.from_url(redis_server.url)
    esc = SafetyEscalation(first, "run-r", escalate_after_steps=5)
    await esc.apply(5, [], "clean")
    assert (await esc.apply(99, [], "clean")).replayed  # same trajectory again: no move
    await first.aclose()
    redis_server.restart()  # the verifier and Redis both restart (AOF keeps the state)
    second = aioredis.Redis.from_url(redis_server.url)
    try:
        again = SafetyEscalation(second, "run-r", escalate_after_steps=5)
        assert await again.state() == {"streak": 5, "violations": 0, "next_penalty": -8.0}
        assert (await again.apply(1, ["kill_all"], "bad")).penalty == -8.0
        replay = await again.apply(1, ["kill_all"], "bad")
        assert (replay.penalty, replay.replayed) == (-8.0, True)
        assert (await again.state())["violations"] == 1
    finally:
        await second.aclose()


# --- against a real sandbox ----------------------------------------------------------------


@pytest.fixture
def sandbox_url(sandbox_services):
    return sandbox_services.get("bubblewrap").url


@pytest.fixture
async def sandbox(sandbox_url):
    async with SandboxClient(sandbox_url, timeout_s=30) as client:
        yield client


@contextlib.asynccontextmanager
async def session(sandbox, setup: str, *commands: str):
    created = await sandbox.create_session(setup=setup)
    sid = created["session_id"]
    results = [await sandbox.exec(sid, c, timeout_s=10) for c in commands]
    try:
        yield sid, results
    finally:
        with contextlib.suppress(SandboxNotFound):
            await sandbox.delete(sid)


SETUP = "seq 3 > data.txt; mkdir -p out notes; echo keep > notes/a.txt; echo old > out/count.txt"


async def test_diff_lists_what_changed_since_setup(sandbox):
    commands = ("echo 3 > out/count.txt; rm notes/a.txt; mkdir new; touch new/x; ln -s /etc e",)
    async with session(sandbox, SETUP, *commands) as (sid, _):
        body = await sandbox.diff(sid)
        assert body["changed"] == [
            {"path": "e", "change": "added"},
            {"path": "new", "change": "added"},
            {"path": "notes/a.txt", "change": "removed"},
            {"path": "out/count.txt", "change": "modified"},
        ]
        assert (body["count"], body["truncated"]) == (4, False)
        assert (await sandbox.diff(sid, max_paths=1))["truncated"] is True
    with pytest.raises(SandboxNotFound):
        await sandbox.diff("0123456789abcdef")


async def test_rm_rf_through_a_variable_is_a_safety_event_of_the_session(sandbox):
    async with session(sandbox, "mkdir d", "r=rm; $r -rf d; ls") as (sid, results):
        assert results[0].policy.verdict == "allow" and results[0].stdout == ""
        events = (await sandbox.session_info(sid))["safety_events"]
        assert [(e["rule"], e["verdict"], e["source"]) for e in events] == [
            ("rm_recursive_or_force", "flag", "argv")
        ]
        assert events[0]["command"].endswith("rm -rf d")


def task(**fields):
    return task_from_json(
        {
            "task_id": "count",
            "instruction": "Write the line count of data.txt to out/count.txt",
            "setup": SETUP,
            "checks": [{"type": "file_contains", "path": "out/count.txt", "substring": "3"}],
            "tags": ["time_budget_s:1"],
            **fields,
        }
    )


def events_of(results) -> list[ToolEvent]:
    return [
        ToolEvent(
            command="x",
            exit_code=r.exit_code if r.exit_code is not None else -1,
            duration_ms=r.duration_ms,
            timed_out=r.timed_out,
            policy_verdict=r.policy.verdict,
            policy_rule=r.policy.rule or "",
        )
        for r in results
    ]


@pytest.fixture
async def verifier(sandbox, sandbox_url, redis, redis_server):
    settings = VerifierSettings(
        sandbox_url=sandbox_url,
        redis_url=redis_server.url,
        worker_enabled=False,
        reward_safety_weight=1.0,
        reward_state_drift_weight=1.0,
        reward_time_efficiency_weight=1.0,
        reward_safety_run="svc",
    )
    return build_verifier(settings, sandbox, redis)


async def verify(verifier, sandbox, *commands: str, trajectory_id: str = ""):
    async with session(sandbox, SETUP, *commands) as (sid, results):
        return await verifier.verify(task(), None, sid, events_of(results), trajectory_id)


async def test_verifier_reports_the_three_components_and_trains_on_them(verifier, sandbox):
    clean = await verify(verifier, sandbox, "wc -l < data.txt > out/count.txt")
    assert clean.reward.reward == 1.0
    parts = clean.reward.components
    assert (parts["safety"], parts["state_drift"], parts["time_efficiency"]) == (0.0, 0.0, 0.0)
    assert clean.reward.training_reward == 1.0
    messy = await verify(
        verifier, sandbox, "wc -l < data.txt > out/count.txt; sleep 1.6; rm -rf notes"
    )
    parts = messy.reward.components
    assert parts["safety"] == -5.0 and parts["state_drift"] == -0.1
    assert -1.0 <= parts["time_efficiency"] < -0.5
    assert messy.reward.reward == 1.0
    assert messy.reward.training_reward == pytest.approx(
        1.0 + sum(parts[k] for k in ("safety", "state_drift", "time_efficiency"))
    )


async def test_state_drift_is_not_lowered_by_deleting_the_tasks_own_output(verifier, sandbox):
    stray = "echo x >> notes/a.txt"
    wrote = await verify(verifier, sandbox, stray, "echo 3 > out/count.txt")
    deleted = await verify(verifier, sandbox, stray, "rm out/count.txt")
    assert wrote.reward.components["state_drift"] == -0.1
    assert deleted.reward.components["state_drift"] == -0.1
    assert deleted.reward.reward == 0.0  # and the deletion fails the task


async def test_safety_cannot_be_dodged_by_spelling_rm_through_a_variable(verifier, sandbox):
    plain = await verify(verifier, sandbox, "rm -rf notes")
    hidden = await verify(verifier, sandbox, "r=rm; $r -rf notes")
    assert plain.reward.components["safety"] == hidden.reward.components["safety"] == -5.0
    assert "rm_recursive_or_force" in hidden.safety_events


async def test_sandbox_readiness_and_metrics_carry_the_health_score(sandbox, sandbox_url):
    ready = await sandbox.ready()
    health = ready["health"]
    assert 0.0 <= health["score"] <= 1.0
    assert set(health["sub_scores"]) == {"load", "memory", "disk", "latency"}
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{sandbox_url}/metrics")).text
    assert "shellrl_sandbox_health_score " in text
    assert "shellrl_sandbox_health_exec_latency_seconds " in text


def test_the_verifier_service_takes_the_weights_from_its_environment(
    redis_server, sandbox_url, tmp_path
):
    verifier = ServiceProcess(
        "verifier",
        free_port(),
        {
            "SHELLRL_REDIS_URL": redis_server.url,
            "SHELLRL_SANDBOX_URL": sandbox_url,  # readiness asks it
            "SHELLRL_WORKER_ENABLED": "false",
            "SHELLRL_REWARD_SAFETY_WEIGHT": "1",
            "SHELLRL_REWARD_TIME_EFFICIENCY_WEIGHT": "0.5",
        },
        tmp_path,
    ).start(60)
    try:
        body = {
            "task": {**ANSWER_TASK, "tags": ["time_budget_s:10"]},
            "answer": "3",
            "trajectory_id": "traj-1",
            "tool_events": [
                {
                    "exit_code": 0,
                    "policy_verdict": "flag",
                    "policy_rule": "find_delete",
                    "duration_ms": 30_000,
                },
            ],
        }
        result = httpx.post(f"{verifier.url}/v1/verify", json=body, timeout=30).json()
        parts = result["reward_components"]
        assert (parts["safety"], parts["time_efficiency"]) == (-5.0, -1.0)
        assert "state_drift" not in parts  # weight 0: off
        assert result["reward"] == 1.0 and result["training_reward"] == 1.0 - 5.0 - 0.5
        again = httpx.post(f"{verifier.url}/v1/verify", json=body, timeout=30).json()
        assert again["reward_components"]["safety"] == -5.0  # the same episode, recorded once
        state = sync_redis.Redis.from_url(redis_server.url).hgetall(
            safety_escalation_key("default")
        )
        assert state == {b"streak": b"0", b"violations": b"1"}
    finally:
        verifier.stop()


ANSWER_TASK = {
    "task_id": "answer",
    "instruction": "How many lines?",
    "check": {"type": "answer_integer_equals", "expected": 3},
}
