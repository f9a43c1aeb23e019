"""The fakes of tests/fakes speak what the real services and clients speak now (issue 37: the
rollout benchmark's fakes drifted: no `/readyz`, no `create_session_when_free`).

Routes: every route a fake serves is a route of the real FastAPI app (same method, path and status
code), built over a stub of its heavy part (the engine's model runtime, the sandbox's session
manager), and every fake serves what the shared readiness wait asks for. Clients: the in-process
fakes have the real client's public methods with the same parameters. Behaviour: one episode of
the real agent loop over each fake ends without a failure.
"""

from __future__ import annotations

import inspect
from unittest import mock

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from services.rollout.agent_loop import AgentLoop
from services.rollout.episode_spec import EpisodeLimits, EpisodeSpec
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox import SandboxClient
from shellrl.contract import Failure, task_from_json
from shellrl.service.main import wait_until_ready
from tests.fakes import fake_sandbox
from tests.fakes.fake_engine import DelayedEngine, ScriptedEngine, fixed_reply, serve_in_thread
from tests.fakes.fake_sandbox import FakeSandbox


def routes(app: FastAPI) -> dict[tuple[str, str], int | None]:
    """{(method, path): declared status code} of every route of `app`."""
    return {
        (method, route.path): route.status_code
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }


def real_engine_app() -> FastAPI:
    """The engine's real routes over a stub runtime (no model loaded, no scheduler started)."""
    from services.engine.app import create_engine_app
    from services.engine.parts import parts_over

    runtime = mock.MagicMock()
    runtime.settings.api_token_value.return_value = None
    runtime.settings.public_dict.return_value = {}
    return create_engine_app(parts_over(runtime))


def real_sandbox_app(tmp_path) -> FastAPI:
    """The sandbox's real routes over a stub session manager (no isolation probe, no root)."""
    from services.sandbox.app import create_sandbox_app
    from services.sandbox.parts import parts_over

    manager = mock.MagicMock(policies={}, max_timeout_s=600.0, root=tmp_path)
    manager.isolation.layer = "fake"
    return create_sandbox_app(parts_over(manager, {}, {}, ttl_sweep_interval_s=60.0))


def fake_engine_app() -> FastAPI:
    return ScriptedEngine(fixed_reply([1], eot_id=2)).app()


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if inspect.isfunction(member) and (not name.startswith("_") or name.startswith("__a"))
    }


def parameters(signature: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def test_every_route_of_the_fake_engine_is_a_route_of_the_real_engine():
    real, fake = routes(real_engine_app()), routes(fake_engine_app())
    assert {key: fake[key] for key in fake} == {key: real.get(key, "missing") for key in fake}


def test_every_route_of_the_fake_sandbox_is_a_route_of_the_real_sandbox(tmp_path):
    real, fake = routes(real_sandbox_app(tmp_path)), routes(fake_sandbox.build_app())
    assert {key: fake[key] for key in fake} == {key: real.get(key, "missing") for key in fake}


@pytest.mark.parametrize("build", [fake_engine_app, fake_sandbox.build_app])
def test_the_shared_readiness_wait_accepts_each_fake(build):
    server = serve_in_thread(build())
    try:
        wait_until_ready(server.url, 10, what="fake", poll_s=0.05)
    finally:
        server.stop()


def test_fake_sandbox_has_every_public_method_of_the_sandbox_client_with_its_parameters():
    real, fake = public_methods(SandboxClient), public_methods(FakeSandbox)
    real.pop("__init__", None)
    assert sorted(fake) == sorted(real)
    for name, signature in real.items():
        assert parameters(fake[name]) == parameters(signature), name
        assert inspect.iscoroutinefunction(getattr(FakeSandbox, name)) == (
            inspect.iscoroutinefunction(getattr(SandboxClient, name))
        ), name


def test_delayed_engine_generate_takes_the_parameters_of_engine_client_generate():
    assert parameters(inspect.signature(DelayedEngine.generate)) == parameters(
        inspect.signature(EngineClient.generate)
    )


TASK = task_from_json(
    {
        "task_id": "fake",
        "instruction": "Print the number of files in this directory.",
        "check": {"type": "answer_integer_equals", "expected": 0},
        "max_turns": 2,
    }
)


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))


async def test_an_episode_of_the_agent_loop_against_the_fake_services_ends_without_failure(chat):
    reply = chat.tokenizer("<bash>true</bash>", add_special_tokens=False)["input_ids"]
    engine_app = ScriptedEngine(fixed_reply(reply, eot_id=chat.end_of_turn_id)).app()
    async with (
        EngineClient("http://engine", transport=httpx.ASGITransport(engine_app)) as engine,
        SandboxClient(
            "http://sandbox", transport=httpx.ASGITransport(fake_sandbox.build_app())
        ) as sandbox,
    ):
        agent = AgentLoop(engine, sandbox, chat, EpisodeLimits(max_turns=2))
        traj = await agent.run(EpisodeSpec(TASK, "fake-0", group_id="g-fake", group_size=1))
    assert (Failure.Name(traj.failure), traj.failure_detail) == ("FAILURE_NONE", "")
    assert traj.num_turns == 2


async def test_an_episode_of_the_agent_loop_against_the_in_process_fakes_ends_without_failure(
    chat,
):
    reply = chat.tokenizer("<bash>true</bash>", add_special_tokens=False)["input_ids"]
    engine = DelayedEngine(reply + [chat.end_of_turn_id], lambda rid: 0.0)
    agent = AgentLoop(engine, FakeSandbox(), chat, EpisodeLimits(max_turns=2))
    traj = await agent.run(EpisodeSpec(TASK, "fake-0", group_id="g-fake", group_size=1))
    assert (Failure.Name(traj.failure), traj.failure_detail) == ("FAILURE_NONE", "")
    assert traj.num_turns == 2
    assert len(engine.busy_s) == 2
