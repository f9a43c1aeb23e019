"""Several real sandbox services behind one SandboxFleet (shellrl/clients/sandbox_fleet.py):
sessions spread by load, later calls reach the owner, a full fleet makes creates wait."""

from __future__ import annotations

import asyncio

import pytest

from shellrl.clients.sandbox import SandboxBusy, SandboxClient, SandboxNotFound
from shellrl.clients.sandbox_fleet import SEPARATOR, SandboxFleet, member_key
from tests.helpers.waiting import wait_until_async


def two_services(sandbox_services):
    """Two distinct services of 2 sessions each (shared by this module's tests)."""
    return [
        sandbox_services.get(
            "bubblewrap", session_ttl_s=str(1800 + i), max_sessions="2", admission_retry_after_s="1"
        )
        for i in range(2)
    ]


async def test_sessions_spread_over_both_services_and_later_calls_reach_the_owner(
    sandbox_services,
):
    services = two_services(sandbox_services)
    urls = [s.url for s in services]
    async with SandboxFleet(urls, refresh_s=0.0) as fleet:
        sessions = [
            await fleet.create_session(setup=f"echo {i} > mine.txt", env={"N": str(i)})
            for i in range(4)
        ]
        assert sorted(s["sandbox_url"] for s in sessions) == sorted(urls * 2)
        for i, session in enumerate(sessions):
            key, _, raw = session["session_id"].partition(SEPARATOR)
            assert key == member_key(session["sandbox_url"]) and raw
            result = await fleet.exec(session["session_id"], 'cat mine.txt; echo "$N"')
            assert result.stdout == f"{i}\n{i}\n"
            assert (await fleet.read_file(session["session_id"], "mine.txt")) == f"{i}\n".encode()
            other = next(u for u in urls if u != session["sandbox_url"])
            async with SandboxClient(session["sandbox_url"]) as owner, SandboxClient(other) as no:
                assert (await owner.session_info(raw))["session_id"] == raw
                with pytest.raises(SandboxNotFound):
                    await no.session_info(raw)
        for session in sessions:
            await fleet.delete(session["session_id"])
        with pytest.raises(SandboxNotFound):
            await fleet.exec(sessions[0]["session_id"], "true")


async def test_a_full_service_is_skipped_and_a_full_fleet_makes_creates_wait_not_fail(
    sandbox_services,
):
    services = two_services(sandbox_services)
    async with SandboxFleet([s.url for s in services], refresh_s=0.0) as fleet:
        full = SandboxFleet(services[0].url)  # the first service filled from outside the fleet
        outside = [await full.create_session() for _ in range(2)]
        first, second = [await fleet.create_session() for _ in range(2)]
        assert first["sandbox_url"] == second["sandbox_url"] == services[1].url
        with pytest.raises(SandboxBusy) as info:
            await fleet.create_session()
        assert info.value.retry_after_s is not None and info.value.retry_after_s <= 1.0
        waiting = asyncio.create_task(fleet.create_session_when_free(poll_s=0.05))
        await wait_until_async(lambda: fleet.waiting == 1, 5.0, "a create waiting")
        status = fleet.status()
        assert status["waiting"] == 1
        assert {m["last_refusal_reason"] for m in status["members"]} == {"sessions"}
        await full.delete(outside[0]["session_id"])
        third, waited_s = await asyncio.wait_for(waiting, 10.0)
        assert third["sandbox_url"] == services[0].url and waited_s > 0
        assert fleet.waiting == 0 and fleet.status()["waits_total"] == 1
        for session in (first, second, third):
            await fleet.delete(session["session_id"])
        await full.delete(outside[1]["session_id"])
        await full.aclose()


async def test_a_fleet_of_one_keeps_the_services_session_ids(sandbox_services):
    service = sandbox_services.get("bubblewrap")
    async with SandboxFleet(service.url) as fleet, SandboxClient(service.url) as direct:
        session = await fleet.create_session(setup="echo hi > a.txt")
        assert SEPARATOR not in session["session_id"]
        assert (await direct.exec(session["session_id"], "cat a.txt")).stdout == "hi\n"
        await fleet.delete(session["session_id"])
