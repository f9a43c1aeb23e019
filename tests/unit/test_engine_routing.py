"""EngineClient routing over a fleet whose members change at run time, and EnginePin: one engine per
episode, moved to another from the same tokens when it fails. The engines are FAKE HTTP handlers
(httpx.MockTransport) that inject the faults: a refused connection, a stale weight version."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.rollout.engine_pin import EnginePin
from shellrl.clients.engine import EngineClient, EngineNotRoutable, StaleEngine
from shellrl.clients.engine_responses import EngineError, EngineUnavailable


def _answer(version: str = "3", ids: tuple[int, ...] = (11, 12)) -> dict:
    return {
        "text": "",
        "output_ids": list(ids),
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "stop", "matched": ids[-1]},
            "prompt_tokens": 2,
            "completion_tokens": len(ids),
            "weight_version": version,
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        },
    }


class Fleet:
    """FAKE engines by host: `down` refuse connections, `versions` set each one's weight_version,
    `status` answers an HTTP error; every /generate is recorded as (host, input_ids, rid)."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.versions: dict[str, str] = {}
        self.status: dict[str, int] = {}
        self.calls: list[tuple[str, list[int], str]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        self.calls.append((host, body["input_ids"], body["rid"]))
        if host in self.status:
            return httpx.Response(self.status[host], json={"error": {"message": "bad"}})
        return httpx.Response(200, json=_answer(self.versions.get(host, "3")))

    def client(self, urls, **kwargs) -> EngineClient:
        transport = httpx.MockTransport(self.handler)
        return EngineClient(urls, transport=transport, retry_backoff_s=0, **kwargs)


async def test_a_pinned_engine_that_takes_no_traffic_raises_not_routable_and_nothing_is_sent():
    fleet = Fleet()
    async with fleet.client(["http://a", "http://b"]) as client:
        client.set_available("http://a", False)
        with pytest.raises(EngineNotRoutable, match="out of rotation"):
            await client.generate([1, 2], {}, url="http://a")
        client.remove_url("http://b")
        with pytest.raises(EngineNotRoutable, match="not a member"):
            await client.generate([1, 2], {}, url="http://b")
        assert fleet.calls == [] and client.urls == ["http://a"]


async def test_an_answer_below_the_staleness_floor_is_discarded_and_its_engine_skipped_until_cleared():
    fleet = Fleet()
    fleet.versions = {"a": "default", "b": "3"}  # a restarted engine serves its initial weights
    async with fleet.client(["http://a", "http://b"]) as client:
        client.routing.version_floor = lambda url: 2  # current version 3, max_staleness 1
        with pytest.raises(StaleEngine, match="weight_version 0") as raised:
            await client.generate([1, 2], {})  # the first pick of a tie is a
        assert raised.value.url == "http://a" and raised.value.version == 0
        assert client.routing.routable() == ["http://b"]
        results = [await client.generate([1, 2], {}) for _ in range(3)]
        assert {r.engine_url for r in results} == {"http://b"}
        fleet.versions["a"] = "3"
        client.routing.clear_stale("http://a")  # the learner confirmed a push to it
        assert client.routing.routable() == ["http://a", "http://b"]


async def test_a_pick_with_no_routable_engine_waits_for_one_up_to_route_wait_s():
    fleet = Fleet()
    async with fleet.client(["http://a"], route_wait_s=5.0) as client:
        client.set_available("http://a", False)
        asyncio.get_running_loop().call_later(0.2, client.set_available, "http://a", True)
        result = await client.generate([1, 2], {})
        assert result.engine_url == "http://a"
    async with fleet.client([], allow_empty=True, route_wait_s=0.1) as client:
        with pytest.raises(EngineNotRoutable, match="no engine is routable"):
            await client.generate([1, 2], {})


async def test_members_set_at_run_time_receive_traffic_and_control_calls():
    fleet = Fleet()
    async with fleet.client([], allow_empty=True) as client:
        client.routing.set_members({"http://a": True, "http://b": False})
        assert client.urls == ["http://a", "http://b"]
        assert {(await client.generate([1], {})).engine_url for _ in range(4)} == {"http://a"}
        client.routing.set_members({"http://b": True})
        assert client.urls == ["http://b"] and client.in_flight() == {"http://b": 0}
        assert (await client.generate([1], {})).engine_url == "http://b"


async def test_a_pinned_episode_moves_to_another_engine_with_the_same_tokens_when_its_engine_dies():
    fleet = Fleet()
    async with fleet.client(["http://a", "http://b"], connect_retries=1) as client:
        pin = EnginePin(client)
        first, _ = await pin.generate([1, 2], {}, "ep-t0-r0")
        assert first.engine_url == "http://a" and pin.url == "http://a"
        await pin.generate([1, 2, 11, 12, 5], {}, "ep-t1-r0")
        fleet.down.add("a")
        result, rid = await pin.generate([1, 2, 11, 12, 5, 11, 12, 6], {}, "ep-t2-r0")
        assert result.engine_url == "http://b" and pin.url == "http://b" and rid == "ep-t2-r0-f1"
        # every request went to a until it died; the moved one carried exactly the same tokens
        assert [(h, r) for h, _, r in fleet.calls] == [
            ("a", "ep-t0-r0"),
            ("a", "ep-t1-r0"),
            ("b", "ep-t2-r0-f1"),
        ]
        assert fleet.calls[-1][1] == [1, 2, 11, 12, 5, 11, 12, 6]
        await pin.generate([9], {}, "ep-t3-r0")
        assert fleet.calls[-1][0] == "b"  # pinned to the new engine from then on


async def test_moves_are_bounded_and_bad_answers_never_move():
    fleet = Fleet()
    fleet.down = {"a", "b"}
    async with fleet.client(["http://a", "http://b"], connect_retries=0) as client:
        pin = EnginePin(client, max_failovers=2)
        with pytest.raises(EngineUnavailable, match="cannot connect"):
            await pin.generate([1, 2], {}, "ep-t0-r0")
        assert pin.failovers == 2
    fleet = Fleet()
    fleet.status = {"a": 400}
    async with fleet.client(["http://a", "http://b"]) as client:
        pin = EnginePin(client)
        with pytest.raises(EngineError):
            await pin.generate([1, 2], {}, "ep-t0-r0")
        assert pin.failovers == 0 and [h for h, _, _ in fleet.calls] == ["a"]


async def test_an_unpinned_episode_routes_every_request_by_load():
    fleet = Fleet()
    async with fleet.client(["http://a", "http://b"]) as client:
        pin = EnginePin(client, pinned=False)
        for turn in range(4):
            await pin.generate([1, 2], {}, f"ep-t{turn}-r0")
        assert [h for h, _, _ in fleet.calls] == ["a", "b", "a", "b"]  # ties go round-robin
