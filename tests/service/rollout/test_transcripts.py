"""`GET /v1/trajectories/{id}` and `shellrl show`: a real gateway process (worker off, bearer token
on) over real Redis, reading trajectories that the verifier's own producer code appended to the
scored streams; the CLI runs as a real subprocess against it. No engine is needed: the gateway only
decodes tokens with the tiny tokenizer."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from cli.main import main as cli_main
from services.rollout import transcripts
from services.rollout.prompt import ChatFormat
from shellrl.contract import action_segment, observation_segment, task_to_json
from shellrl.contract.trajectory import set_check_results
from shellrl.streams import STREAM_EVALUATIONS, STREAM_TRAJECTORIES, StreamProducer
from shellrl.streams import idempotency_key as idem_key
from shellrl.v1.trajectory_pb2 import EpisodeEnd, Failure, ToolEvent, Trajectory
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO, ServiceProcess
from tests.helpers.redis_server import free_port
from tests.service.rollout.conftest import make_task

TOKEN = "transcripts-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def gateway(module_redis_server, tmp_path_factory):
    proc = ServiceProcess(
        "rollout",
        free_port(),
        {
            "SHELLRL_REDIS_URL": module_redis_server.url,
            "SHELLRL_API_TOKEN": TOKEN,
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_WORKER_ENABLED": "false",
        },
        tmp_path_factory.mktemp("transcripts-logs"),
    ).start(120)
    yield proc
    proc.stop()


def trajectory(chat: ChatFormat, trajectory_id: str, **fields) -> Trajectory:
    """Two turns: `ls` (exit 0, output 'numbers.txt') then an answer; policy versions 3 and 4."""
    traj = Trajectory(
        trajectory_id=trajectory_id,
        task_id="t-lines",
        group_id="g-1",
        prompt_ids=b"".join(i.to_bytes(4, "little") for i in chat.encode("Count the lines.")),
        task=make_task(),
        num_turns=2,
        answer="5",
        end=EpisodeEnd.EPISODE_END_ANSWER,
        scored=True,
        reward=1.0,
        training_reward=1.0,
        split="train",
        **fields,
    )
    traj.reward_components["outcome"] = 1.0
    set_check_results(
        traj,
        [
            {"type": "answer_integer_equals", "passed": True, "detail": "5 == 5"},
            {
                "type": "file_exists",
                "passed": True,
                "detail": "numbers.txt exists",
                "duration_ms": 2,
            },
        ],
    )
    first, second = chat.encode("<bash>ls</bash>"), chat.encode("<answer>5</answer>")
    output = chat.encode("numbers.txt")
    traj.segments.extend(
        [
            action_segment(first, [0.0] * len(first), 3, turn=0),
            observation_segment(output, tool_event=ToolEvent(command="ls", exit_code=0), turn=0),
            action_segment(second, [0.0] * len(second), 4, turn=1),
        ]
    )
    return traj


def publish(redis_url: str, stream: str, traj: Trajectory) -> None:
    """Append `traj` as the verifier does (StreamProducer.add under the trajectory id's key)."""

    async def add() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            await StreamProducer(redis, stream).add(
                traj.SerializeToString(), idempotency_key=traj.trajectory_id, task_id=traj.task_id
            )
        finally:
            await redis.aclose()

    asyncio.run(add())


@pytest.fixture(scope="module")
def published(module_redis_server, chat):
    url = module_redis_server.url
    publish(url, STREAM_TRAJECTORIES, trajectory(chat, "traj-ok"))
    unscored = trajectory(chat, "traj-eval", eval=True, evaluation_id="ev-1")
    unscored.scored, unscored.reward, unscored.training_reward = False, float("nan"), float("nan")
    unscored.failure = Failure.FAILURE_TIMEOUT_BUDGET
    publish(url, STREAM_EVALUATIONS, unscored)
    publish(url, STREAM_TRAJECTORIES, trajectory(chat, "traj-keyless"))
    sync_redis.Redis.from_url(url).delete(idem_key(STREAM_TRAJECTORIES, "traj-keyless"))
    return url


def get(gateway, path: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{gateway.url}{path}", headers=headers, timeout=30)


def test_a_finished_trajectory_reads_back_with_text_tokens_versions_and_reward(
    gateway, published, chat
):
    r = get(gateway, "/v1/trajectories/traj-ok")
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["stream"] == STREAM_TRAJECTORIES and view["task"] == task_to_json(make_task())
    assert view["prompt"]["text"] == "Count the lines."
    assert view["prompt"]["token_ids"] == chat.encode("Count the lines.")
    [turn0, turn1] = view["turns"]
    action, observation = turn0["segments"]
    assert (action["kind"], action["text"], action["policy_version"]) == (
        "action",
        "<bash>ls</bash>",
        3,
    )
    assert action["token_ids"] == chat.encode("<bash>ls</bash>")
    assert observation["text"] == "numbers.txt" and observation["policy_version"] == -1
    assert observation["tool"]["command"] == "ls" and observation["tool"]["exit_code"] == 0
    assert turn1["segments"][0]["policy_version"] == 4 and view["policy_versions"] == [3, 4]
    assert (view["reward"], view["reward_components"], view["failure"], view["end"]) == (
        1.0,
        {"outcome": 1.0},
        "none",
        "answer",
    )
    assert view["checks"] == [
        {"type": "answer_integer_equals", "passed": True, "detail": "5 == 5", "duration_ms": 0.0},
        {"type": "file_exists", "passed": True, "detail": "numbers.txt exists", "duration_ms": 2.0},
    ]


def test_eval_trajectories_and_ones_whose_key_expired_are_found_and_nan_reads_as_null(
    gateway, published
):
    view = get(gateway, "/v1/trajectories/traj-eval").json()
    assert view["stream"] == STREAM_EVALUATIONS and view["evaluation_id"] == "ev-1"
    assert view["reward"] is None and view["failure"] == "timeout_budget" and not view["scored"]
    assert get(gateway, "/v1/trajectories/traj-keyless").json()["trajectory_id"] == "traj-keyless"


def test_an_unknown_id_is_404_naming_it_and_no_token_is_401(gateway, published):
    r = get(gateway, "/v1/trajectories/no-such-traj")
    assert r.status_code == 404
    assert r.json()["error"]["field"] == "trajectory_id"
    assert "no-such-traj" in r.json()["error"]["message"]
    assert get(gateway, "/v1/trajectories/traj-ok", token=None).status_code == 401


def show(gateway, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHELLRL_")}
    env.update(SHELLRL_API_TOKEN=token, COLUMNS="120")
    return run_owned(
        [sys.executable, "-m", "cli.main", "show", *args, "--url", gateway.url],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout_s=60,
    )


def test_show_prints_the_episode_readably_and_as_json_with_the_stacks_token(
    gateway, published, capsys, monkeypatch
):
    shown = show(gateway, "traj-ok")
    assert shown.returncode == 0, shown.stderr
    for text in ("How many lines", "Count the lines.", "<bash>ls</bash>", "numbers.txt", "$ ls"):
        assert text in shown.stdout
    assert "policy v3" in shown.stdout and "policy v4" in shown.stdout and "outcome" in shown.stdout
    assert "checks (verifier)" in shown.stdout and "numbers.txt exists" in shown.stdout
    monkeypatch.setenv("SHELLRL_API_TOKEN", TOKEN)  # the same command, in this process
    assert cli_main(["show", "traj-ok", "--json", "--url", gateway.url]) == 0
    assert json.loads(capsys.readouterr().out)["policy_versions"] == [3, 4]
    assert cli_main(["show", "no-such-traj", "--url", gateway.url]) == 1
    assert "no finished trajectory or task 'no-such-traj'" in capsys.readouterr().err
    monkeypatch.setenv("SHELLRL_API_TOKEN", "wrong-token-wrong-token-wrong-token-00")
    assert cli_main(["show", "traj-ok", "--url", gateway.url]) == 2
    assert "401" in capsys.readouterr().err


def test_the_fallback_search_pages_back_through_the_stream_up_to_its_limit(
    published, chat, monkeypatch
):
    for i in range(4):  # traj-deep, then three newer ones above it
        publish(published, STREAM_TRAJECTORIES, trajectory(chat, f"traj-deep-{i}"))
    sync_redis.Redis.from_url(published).delete(idem_key(STREAM_TRAJECTORIES, "traj-deep-0"))
    monkeypatch.setattr(transcripts, "SCAN_PAGE", 2)

    async def find(limit: int):
        monkeypatch.setattr(transcripts, "SCAN_LIMIT", limit)
        redis = aioredis.Redis.from_url(published)
        try:
            return await transcripts.find_trajectory(redis, "traj-deep-0")
        finally:
            await redis.aclose()

    found = asyncio.run(find(1_000))
    assert found is not None and found[0].trajectory_id == "traj-deep-0"
    assert asyncio.run(find(2)) is None  # only the two newest entries were searched


def test_a_task_id_lists_its_newest_trajectories_and_show_prints_the_newest(
    gateway, published, chat
):
    for i, finished_at in enumerate((100.0, 300.0, 200.0)):
        traj = trajectory(chat, f"traj-task-{i}", finished_at=finished_at)
        traj.task_id = "t-other"
        if i == 2:
            traj.scored, traj.reward = False, float("nan")
            traj.failure = Failure.FAILURE_INFRA_SANDBOX
            del traj.checks[:]
        publish(published, STREAM_TRAJECTORIES, traj)
    listed = get(gateway, "/v1/trajectories?task_id=t-other&limit=2").json()
    assert [t["trajectory_id"] for t in listed["trajectories"]] == ["traj-task-1", "traj-task-2"]
    newest, unscored = listed["trajectories"]
    assert (newest["reward"], newest["checks_passed"], newest["checks"]) == (1.0, 2, 2)
    assert (unscored["reward"], unscored["failure"], unscored["checks"]) == (
        None,
        "infra_sandbox",
        0,
    )
    assert get(gateway, "/v1/trajectories?task_id=nothing").json()["trajectories"] == []
    bad = get(gateway, "/v1/trajectories?task_id=t-other&limit=0")
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "limit"
    assert get(gateway, "/v1/trajectories").status_code == 422
    assert get(gateway, "/v1/trajectories?task_id=t-other", token=None).status_code == 401
    shown = show(gateway, "t-other")
    assert shown.returncode == 0, shown.stderr
    assert "task t-other: newest trajectory traj-task-1" in shown.stdout
    assert "also traj-task-2: unscored, failure infra_sandbox, checks 0/0" in shown.stdout
    assert "checks (verifier)" in shown.stdout
