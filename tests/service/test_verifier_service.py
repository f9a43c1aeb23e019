"""The verifier as a service: real Redis, real sandbox and verifier subprocesses.

Stream stage (group isolation, pass-through, eval routing, dead letters, session release), a crash
between the downstream XADD and the XACK, SIGKILL in the middle of a stream, and the HTTP API.
"""

from __future__ import annotations

import math

import httpx
import pytest

from cli.job_stack import check_verifier_config
from services.verifier.checks import VERIFIER_VERSION
from shellrl import streams
from shellrl.clients.sandbox import SandboxClient, SandboxNotFound
from shellrl.contract import (
    EpisodeEnd,
    Failure,
    ToolEvent,
    Trajectory,
    action_segment,
    observation_segment,
    parse_trajectory,
    task_to_json,
)
from shellrl.streams.keys import STREAM_EVALUATIONS, errors_key
from tasksets.seeds import seed_tasks
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.slow
NUMBERS = next(t for t in seed_tasks() if t.task_id == "seed-numbers")


def verifier_process(redis_url: str, sandbox_url: str, log_dir, name: str, **env) -> ServiceProcess:
    return ServiceProcess(
        "verifier",
        free_port(),
        {
            "SHELLRL_REDIS_URL": redis_url,
            "SHELLRL_SANDBOX_URL": sandbox_url,
            "SHELLRL_CONSUMER_NAME": name,
            "SHELLRL_CLAIM_MIN_IDLE_MS": "500",
            "SHELLRL_BLOCK_MS": "200",
            **{k.upper(): str(v) for k, v in env.items()},
        },
        log_dir,
    )


def trajectory(tid: str, group: str, session_id: str, answer: str | None, **fields) -> Trajectory:
    traj = Trajectory(
        trajectory_id=tid,
        task_id=NUMBERS.task_id,
        group_id=group,
        task=NUMBERS,
        sandbox_session_id=session_id,
        answer=answer or "",
        end=EpisodeEnd.EPISODE_END_ANSWER
        if answer is not None
        else EpisodeEnd.EPISODE_END_MAX_TURNS,
        prompt_ids=b"\x01\x00\x00\x00",
        **fields,
    )
    traj.segments.append(action_segment([5, 6], [-0.1, -0.2], policy_version=3))
    traj.segments.append(observation_segment([7], tool_event=ToolEvent(command="ls", exit_code=0)))
    return traj


async def publish(redis, *trajs: Trajectory) -> None:
    producer = streams.StreamProducer(redis, streams.STREAM_EPISODES)
    for t in trajs:
        await producer.add(
            t.SerializeToString(),
            idempotency_key=t.trajectory_id,
            task_id=t.task_id,
            group_id=t.group_id,
            version="3",
        )


async def read_stream(redis, stream: str) -> list[Trajectory]:
    return [parse_trajectory(fields[b"pb"]) for _, fields in await redis.xrange(stream)]


async def test_group_members_are_scored_independently_and_failures_pass_through(
    redis_server, sandbox_url, tmp_path
):
    redis = streams.connect(redis_server.url)
    proc = verifier_process(
        redis_server.url, sandbox_url, tmp_path, "v1", shellrl_max_deliveries=1
    ).start()
    try:
        async with SandboxClient(sandbox_url) as sandbox:
            sids = [(await sandbox.create_session())["session_id"] for _ in range(5)]
            await sandbox.exec(sids[0], NUMBERS.reference_solution)  # member 0 solves it
            await sandbox.delete(sids[2])  # member 2's session is gone
            members = [
                trajectory("t0", "g", sids[0], "5"),
                trajectory("t1", "g", sids[1], "5"),  # right answer, no numbers.txt
                trajectory("t2", "g", sids[2], "5"),
                trajectory(
                    "t3",
                    "g",
                    sids[3],
                    None,
                    failure=Failure.FAILURE_INFRA_ENGINE,
                    failure_detail="engine down",
                ),
            ]
            eval_traj = trajectory("e0", "ge", sids[4], "5", eval=True)
            await publish(redis, *members, eval_traj)
            await redis.xadd(streams.STREAM_EPISODES, {"pb": b"\xff\x00garbage", "task_id": "x"})

            out = await wait_until_async(
                lambda: _len_at_least(redis, streams.STREAM_TRAJECTORIES, 4), what="4 scored"
            )
            by_id = {t.trajectory_id: t for t in out}
            assert set(by_id) == {"t0", "t1", "t2", "t3"}
            assert (
                by_id["t0"].scored
                and by_id["t0"].reward == 1.0
                and by_id["t0"].training_reward == 1.0
            )
            assert by_id["t1"].scored and by_id["t1"].reward == 0.0
            # the per-check results travel in the trajectory (transcripts, `shellrl show`)
            assert [(c.type, c.passed) for c in by_id["t0"].checks] == [
                ("answer_integer_equals", True),
                ("file_exists", True),
                ("command_output_equals", True),
            ]
            assert [c.passed for c in by_id["t1"].checks] == [True, False, False]
            assert not by_id["t2"].checks and not by_id["t3"].checks  # could not run / not run
            assert by_id["t0"].reward_components["exit_zero_bonus"] == pytest.approx(0.1)
            assert not by_id["t2"].scored and by_id["t2"].failure == Failure.FAILURE_INFRA_VERIFIER
            assert math.isnan(by_id["t2"].reward) and "gone" in by_id["t2"].failure_detail
            assert not by_id["t3"].scored and by_id["t3"].failure == Failure.FAILURE_INFRA_ENGINE
            assert all(t.verifier_version == VERIFIER_VERSION == "verifier-2" for t in out)
            evals = await wait_until_async(
                lambda: _len_at_least(redis, STREAM_EVALUATIONS, 1), what="eval result"
            )
            assert (
                evals[0].trajectory_id == "e0" and evals[0].reward == 0.0
            )  # routed apart, never trained on
            dead = await wait_until_async(
                lambda: redis.xrange(streams.STREAM_DEAD), what="dead letter"
            )
            assert b"undecodable" in dead[0][1][b"reason"]
            for sid in (
                sids[0],
                sids[1],
                sids[3],
                sids[4],
            ):  # released after scoring (pass-through too)
                with pytest.raises(SandboxNotFound):
                    await sandbox.session_info(sid)
            await wait_until_async(lambda: _pending_is(redis, 0), what="nothing pending")
            async with httpx.AsyncClient() as http:  # the worker exports its stream's gauges
                text = (await http.get(f"{proc.url}/metrics")).text
            for series in (
                'shellrl_stream_length{stream="shellrl:episodes"}',
                'shellrl_stream_pending{group="verifier",stream="shellrl:episodes"}',
                'shellrl_stream_lag{group="verifier",stream="shellrl:episodes"}',
            ):
                assert series in text
    finally:
        proc.stop()
        await redis.aclose()


async def test_the_session_is_released_only_after_the_result_is_durable(
    redis_server, sandbox_url, tmp_path
):
    """A forward that fails (here: shellrl:trajectories holds a key of the wrong type, so XADD
    fails) leaves the episode pending; the retry must find the sandbox session and score it.
    Released before the forward, the retry found it gone and scored an INFRA failure (issue 15)."""
    redis = streams.connect(redis_server.url)
    await redis.set(streams.STREAM_TRAJECTORIES, "not a stream")
    proc = verifier_process(redis_server.url, sandbox_url, tmp_path, "v1").start()
    try:
        async with SandboxClient(sandbox_url) as sandbox:
            sid = (await sandbox.create_session())["session_id"]
            await sandbox.exec(sid, NUMBERS.reference_solution)
            await publish(redis, trajectory("durable-1", "g", sid, "5"))
            errors = errors_key(streams.STREAM_EPISODES, streams.GROUP_VERIFIER)
            await wait_until_async(lambda: redis.hlen(errors), what="the failed forward")
            assert (await sandbox.session_info(sid))["session_id"] == sid  # not released
            await redis.delete(streams.STREAM_TRAJECTORIES)
            (out,) = await wait_until_async(
                lambda: _len_at_least(redis, streams.STREAM_TRAJECTORIES, 1),
                what="the retried result",
            )
            assert out.scored and out.reward == 1.0 and out.failure == Failure.FAILURE_NONE
            await wait_until_async(lambda: _pending_is(redis, 0), what="nothing pending")
            with pytest.raises(SandboxNotFound):  # released once the result was durable
                await sandbox.session_info(sid)
    finally:
        proc.stop()
        await redis.aclose()


async def test_crash_between_xadd_and_xack_leaves_one_learner_visible_copy(
    redis_server, sandbox_url, tmp_path
):
    """The state a crash between the two halves would leave: the scored trajectory is already in
    shellrl:trajectories (under its idempotency key) but the episode is still pending for a
    consumer that died. A new verifier re-claims and re-verifies it, and only acknowledges."""
    redis = streams.connect(redis_server.url)
    try:
        async with SandboxClient(sandbox_url) as sandbox:
            sid = (await sandbox.create_session())["session_id"]
            await sandbox.exec(sid, NUMBERS.reference_solution)
            traj = trajectory("crash-1", "g", sid, "5")
            await publish(redis, traj)
            dead_consumer = streams.StreamConsumer(
                redis, streams.STREAM_EPISODES, streams.GROUP_VERIFIER, "died"
            )
            await dead_consumer.ensure_group()
            assert len(await dead_consumer.read(block_ms=100)) == 1  # delivered, never acknowledged
            scored = parse_trajectory(traj.SerializeToString())
            scored.scored, scored.reward, scored.training_reward = True, 1.0, 1.0
            await streams.StreamProducer(
                redis, streams.STREAM_TRAJECTORIES
            ).add(  # the XADD half, done
                scored.SerializeToString(), idempotency_key=scored.trajectory_id
            )
        proc = verifier_process(redis_server.url, sandbox_url, tmp_path, "v2").start()
        try:
            await wait_until_async(
                lambda: _pending_is(redis, 0), what="the re-claimed entry to be acknowledged"
            )
            out = await read_stream(redis, streams.STREAM_TRAJECTORIES)
            assert [t.trajectory_id for t in out] == ["crash-1"]
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{proc.url}/metrics")).text
            assert 'shellrl_verifier_trajectories_total{outcome="duplicate"} 1.0' in metrics
        finally:
            proc.stop()
    finally:
        await redis.aclose()


async def test_sigkill_mid_stream_scores_every_trajectory_exactly_once(
    redis_server, sandbox_url, tmp_path
):
    redis = streams.connect(redis_server.url)
    slow = task_to_json(NUMBERS)
    slow["check"].append({"type": "command_exit_code", "command": "sleep 0.2"})
    from shellrl.contract import task_from_json

    slow_task = task_from_json(slow)
    n = 16
    try:
        async with SandboxClient(sandbox_url) as sandbox:
            trajs = []
            for i in range(n):
                sid = (await sandbox.create_session())["session_id"]
                t = trajectory(f"k{i}", f"g{i // 4}", sid, "5")
                t.task.CopyFrom(slow_task)
                trajs.append(t)
            await publish(redis, *trajs)
        first = verifier_process(
            redis_server.url, sandbox_url, tmp_path, "va", shellrl_concurrency=2
        ).start()
        await wait_until_async(
            lambda: _len_at_least(redis, streams.STREAM_TRAJECTORIES, 2), what="a first few scored"
        )
        first.kill()  # SIGKILL: in-flight entries stay pending
        done_before = await redis.xlen(streams.STREAM_TRAJECTORIES)
        assert done_before < n
        second = verifier_process(
            redis_server.url, sandbox_url, tmp_path, "vb", shellrl_concurrency=4
        ).start()
        try:
            await wait_until_async(
                lambda: _len_at_least(redis, streams.STREAM_TRAJECTORIES, n),
                timeout_s=60,
                what="all trajectories",
            )
            await wait_until_async(lambda: _pending_is(redis, 0), what="nothing pending")
            ids = [t.trajectory_id for t in await read_stream(redis, streams.STREAM_TRAJECTORIES)]
            assert sorted(ids) == sorted(t.trajectory_id for t in trajs)  # each exactly once
        finally:
            second.stop()
    finally:
        await redis.aclose()


async def test_http_verify_and_checks(redis_server, sandbox_url, tmp_path):
    proc = verifier_process(
        redis_server.url, sandbox_url, tmp_path, "vh", shellrl_worker_enabled="false"
    ).start()
    try:
        async with (
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http,
            SandboxClient(sandbox_url) as sandbox,
        ):
            checks = (await http.get("/v1/checks")).json()
            assert {c["type"] for c in checks["checks"]} == {
                "answer_equals",
                "answer_integer_equals",
                "answer_matches",
                "file_exists",
                "file_contains",
                "file_sha256",
                "command_output_equals",
                "command_exit_code",
            }
            sid = (await sandbox.create_session())["session_id"]
            await sandbox.exec(sid, NUMBERS.reference_solution)
            body = {
                "task": task_to_json(NUMBERS),
                "answer": "5",
                "session_id": sid,
                "release_session": True,
                "tool_events": [
                    {"exit_code": 0, "timed_out": False, "policy_verdict": "allow"},
                    {
                        "exit_code": None,
                        "timed_out": True,
                        "policy_verdict": "flag",
                        "policy_rule": "rm_recursive_or_force",
                    },
                ],
            }
            result = (await http.post("/v1/verify", json=body)).json()
            assert (
                result["reward"] == 1.0
                and result["training_reward"] == 1.0
                and result["failure"] is None
            )
            assert [c["passed"] for c in result["checks"]] == [True, True, True]
            assert result["reward_components"] == {
                "outcome": 1.0,
                "exit_zero_bonus": 0.1,
                "timeout_penalty": -0.1,
                "safety_penalty": -1.0,
                "ungrounded_success": 0.0,
            }
            with pytest.raises(SandboxNotFound):  # release_session
                await sandbox.session_info(sid)
            again = (await http.post("/v1/verify", json=body)).json()
            assert again["reward"] is None and again["failure"] == "infra_verifier"

            bad = dict(
                body,
                task={
                    **task_to_json(NUMBERS),
                    "check": [{"type": "answer_matches", "pattern": "("}],
                },
            )
            response = await http.post("/v1/verify", json=bad)
            assert (
                response.status_code == 422
                and response.json()["error"]["field"] == "task.check[0].pattern"
            )
            response = await http.post(
                "/v1/verify", json=dict(body, tool_events=[{"exit_code": "zero"}])
            )
            assert (
                response.status_code == 422
                and response.json()["error"]["field"] == "tool_events[0].exit_code"
            )
            metrics = (await http.get("/metrics")).text
            assert (
                'shellrl_verifier_verifications_total{outcome="pass",source="shellrl:seeds",split="train"}'
                in metrics
            )
    finally:
        proc.stop()  # SIGTERM: the lifespan drains and closes (uvicorn then re-raises the signal)
        assert '"msg": "verifier stopped"' in proc.tail()


async def _len_at_least(redis, stream: str, n: int):
    out = await read_stream(redis, stream)
    return out if len(out) >= n else None


async def _pending_is(redis, n: int) -> bool:
    info = await redis.xpending(streams.STREAM_EPISODES, streams.GROUP_VERIFIER)
    return info["pending"] == n


async def test_require_command_makes_a_success_without_commands_train_as_zero(
    redis_server, sandbox_url, tmp_path
):
    proc = verifier_process(
        redis_server.url,
        sandbox_url,
        tmp_path,
        "vr",
        shellrl_worker_enabled="false",
        shellrl_require_command="true",
    ).start()
    try:
        async with (
            httpx.AsyncClient(base_url=proc.url, timeout=30) as http,
            SandboxClient(sandbox_url) as sandbox,
        ):
            results = []
            for tool_events in (
                [],
                [{"exit_code": 0, "timed_out": False, "policy_verdict": "allow"}],
            ):
                sid = (await sandbox.create_session())["session_id"]
                await sandbox.exec(sid, NUMBERS.reference_solution)
                body = {
                    "task": task_to_json(NUMBERS),
                    "answer": "5",
                    "session_id": sid,
                    "release_session": True,
                    "tool_events": tool_events,
                }
                results.append((await http.post("/v1/verify", json=body)).json())
            guess, looked_up = results
            assert (guess["reward"], guess["training_reward"]) == (1.0, 0.0)
            assert guess["reward_components"]["ungrounded_success"] == -1.0
            assert (looked_up["reward"], looked_up["training_reward"]) == (1.0, 1.0)
            assert looked_up["reward_components"]["ungrounded_success"] == 0.0
        check_verifier_config(proc.url, True)  # what the main job checks before it trains
        with pytest.raises(RuntimeError, match="require_command=True"):
            check_verifier_config(proc.url, False)
    finally:
        proc.stop()
