"""Episodes over two real sandbox services (issue 18 item 3): sessions spread over both, and when
both are at their session cap new episodes wait for a session instead of failing. The engine is a
scripted FAKE (a fixed answer after a delay), so that episodes hold their sessions a known time."""

from __future__ import annotations

import asyncio
import time

from services.rollout.episode_spec import EpisodeSpec
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox_fleet import SandboxFleet
from shellrl.contract import Failure
from tests.fakes.fake_engine import Reply, ScriptedEngine, serve_in_thread
from tests.helpers.waiting import wait_until_async
from tests.service.rollout.conftest import make_agent, make_task


async def test_episodes_spread_over_two_full_sandboxes_wait_for_sessions_and_none_fails(
    sandbox_services, chat
):
    services = [
        sandbox_services.get(
            "bubblewrap", max_sessions="1", admission_retry_after_s="1", session_ttl_s=str(900 + i)
        )
        for i in range(2)
    ]
    answer = chat.encode("<answer>5</answer>") + [chat.end_of_turn_id]
    fake = ScriptedEngine(lambda body: Reply(list(answer), delay_s=1.0, matched=answer[-1]))
    server = serve_in_thread(fake.app())
    try:
        async with (
            EngineClient(server.url) as engine,
            SandboxFleet([s.url for s in services], refresh_s=0.0) as fleet,
        ):
            agent = make_agent(engine, fleet, chat, sandbox_busy_poll_s=0.1)
            specs = [EpisodeSpec(make_task(), f"fleet-{i}", keep_session=False) for i in range(4)]
            start = time.monotonic()
            runs = asyncio.gather(*(agent.run(spec) for spec in specs))
            await wait_until_async(lambda: fleet.waiting == 2, 10.0, "two episodes waiting")
            trajectories = await runs
            elapsed = time.monotonic() - start
            status = fleet.status()
    finally:
        server.stop()
    assert [t.failure for t in trajectories] == [Failure.FAILURE_NONE] * 4
    assert all(t.answer == "5" for t in trajectories)
    assert [m["created"] for m in status["members"]] == [2, 2]  # spread over both
    assert elapsed >= 2.0  # two at a time: the fleet never held more than its two sessions
    assert status["waits_total"] == 2 and status["waiting"] == 0
