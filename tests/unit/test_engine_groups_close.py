"""EngineGroups tells an engine to destroy a group the learner closed (issue 30 cleanup): the
name is forgotten once the engine answered (200, or 400: it destroyed the group itself after a
failed broadcast) and kept, for the next group() to destroy, when the engine refused the call
(401: an admin key missing) or did not answer within the bound. The real engine and SGLang's
own scheduler code: tests/service/test_weight_sync_distributed.py,
tests/service/test_sglang_scheduler_harness.py."""

from __future__ import annotations

import asyncio
import json

import httpx

from services.learner.weights import engine_groups
from services.learner.weights.engine_groups import EngineGroups
from shellrl.clients.engine import EngineClient

URL = "http://engine.test:30000"


class DestroyingEngine:
    """FAKE engine (the fault: how it answers /destroy_weights_update_group, set by the test:
    a status, or None for no answer); records the group names it was asked to destroy."""

    def __init__(self) -> None:
        self.status: int | None = 200
        self.asked: list[str] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/destroy_weights_update_group"
        self.asked.append(json.loads(request.content)["group_name"])
        if self.status is None:
            await asyncio.sleep(3600)  # never answers; the caller's bound ends the call
        return httpx.Response(
            self.status, json={"success": self.status == 200, "message": "m", "detail": "d"}
        )


async def test_a_closed_group_is_forgotten_once_the_engine_answered_and_kept_otherwise(
    monkeypatch,
):
    monkeypatch.setattr(engine_groups, "DESTROY_TIMEOUT_S", 0.2)
    fake = DestroyingEngine()
    client = EngineClient([URL], transport=httpx.MockTransport(fake), connect_retries=1)
    groups = EngineGroups(client, backend="gloo", timeout_s=30)
    try:
        for status, kept in ((200, False), (400, False), (401, True), (None, True)):
            fake.status, name = status, f"g-{status}"
            groups._stale = {URL: name}  # a group forget() closed on the learner's side
            await groups.aclose()  # waits for the destroy call, at most DESTROY_TIMEOUT_S
            assert fake.asked[-1] == name
            assert (groups._stale == {URL: name}) is kept, (status, groups._stale)
        assert not groups._destroying  # none left in flight
    finally:
        await client.close()
