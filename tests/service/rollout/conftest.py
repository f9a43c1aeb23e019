"""Fixtures of the rollout-gateway service tests: one real engine (tiny model) and one real sandbox
process for the whole package, started once (engine start-up dominates: ~20 s on 2 loaded cores)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from services.rollout.agent_loop import AgentLoop
from services.rollout.episode_spec import EpisodeLimits
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from shellrl.contract import task_from_json
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port


@pytest.fixture(scope="package")
def engine_process(tmp_path_factory):
    proc = ServiceProcess(
        "engine",
        free_port(),
        {"SHELLRL_MODEL_PATH": "tiny", "SHELLRL_NUM_THREADS": "1"},
        tmp_path_factory.mktemp("engine-logs"),
    ).start(ready_timeout_s=180)
    yield proc
    proc.stop()


def sandbox_service(log_dir, env: dict[str, str] | None = None) -> tuple[ServiceProcess, str]:
    """A sandbox service, not started yet, whose workspace root the per-session uids can traverse
    (pytest's own tmp dirs are 0700, which bubblewrap's unprivileged uid cannot enter)."""
    root = tempfile.mkdtemp(prefix="shellrl-rollout-test-")
    os.chmod(root, 0o755)
    proc = ServiceProcess(
        "sandbox", free_port(), {"SHELLRL_WORKSPACE_ROOT": root, **(env or {})}, log_dir
    )
    return proc, root


def start_sandbox(log_dir, env: dict[str, str] | None = None) -> tuple[ServiceProcess, str]:
    """`sandbox_service`, started."""
    proc, root = sandbox_service(log_dir, env)
    return proc.start(ready_timeout_s=60), root


@pytest.fixture(scope="package")
def sandbox_process(tmp_path_factory):
    proc, root = start_sandbox(tmp_path_factory.mktemp("sandbox-logs"))
    yield proc
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="package")
def chat() -> ChatFormat:
    return ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))


def make_task(instruction: str = "How many lines does numbers.txt have?", **fields):
    return task_from_json(
        {
            "task_id": fields.pop("task_id", "t-lines"),
            "instruction": instruction,
            "setup": fields.pop("setup", "seq 1 5 > numbers.txt"),
            "check": {"type": "answer_integer_equals", "expected": 5},
            **fields,
        }
    )


def make_agent(engine, sandbox, chat: ChatFormat, **limits) -> AgentLoop:
    return AgentLoop(
        engine,
        sandbox,
        chat,
        EpisodeLimits(**{"exec_timeout_s": 5.0, "episode_timeout_s": 120.0, **limits}),
    )
