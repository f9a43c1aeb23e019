"""SandboxFleet's routing rules and the warm pool's setup key, without services."""

from __future__ import annotations

import pytest

from services.sandbox.limits import Limits
from services.sandbox.sessions.warm_pool import SetupSpec
from shellrl.clients.sandbox import SandboxBusy, SandboxError, SandboxNotFound
from shellrl.clients.sandbox_fleet import SandboxFleet, member_key, parse_urls

URLS = "http://10.0.0.5:8101, http://10.0.0.6:8101/,http://10.0.0.5:8101"


def test_urls_are_parsed_deduplicated_and_an_empty_list_is_refused():
    assert parse_urls(URLS) == ["http://10.0.0.5:8101", "http://10.0.0.6:8101"]
    with pytest.raises(ValueError, match="at least one sandbox URL"):
        parse_urls(" , ")


async def test_a_session_id_is_routed_by_its_member_key_and_an_unknown_one_is_404():
    async with SandboxFleet(URLS) as fleet:
        key = member_key("http://10.0.0.6:8101/")
        member, raw = await fleet._owner(f"{key}.abc123")
        assert (member.url, raw) == ("http://10.0.0.6:8101", "abc123")
        for bad in ("abc123", "ffffffff.abc123", f"{key}."):
            with pytest.raises(SandboxNotFound, match="names no sandbox of this fleet"):
                await fleet.exec(bad, "true")


async def test_with_every_member_skipped_a_create_is_busy_or_down_without_a_call():
    async with SandboxFleet(URLS) as fleet:
        for member in fleet.members:
            member.read_at = float("inf")  # no /readyz read
            member.busy_until = float("inf")
        with pytest.raises(SandboxBusy):
            await fleet.create_session()
        for member in fleet.members:
            member.busy_until, member.down_until = 0.0, float("inf")
        with pytest.raises(SandboxError, match="no sandbox service answers") as info:
            await fleet.create_session()
        assert not isinstance(info.value, SandboxBusy)


def test_the_setup_key_covers_setup_env_limits_and_policy():
    limits = Limits(30.0, 60, 1 << 30, 4 << 30, 256, 256 << 20, 256 << 20, 65536, 1024, 1.0)
    base = SetupSpec("echo hi", (("A", "1"),), limits, None)
    assert base.key == SetupSpec("echo hi", (("A", "1"),), limits, None).key
    others = [
        SetupSpec("echo ho", (("A", "1"),), limits, None),
        SetupSpec("echo hi", (("A", "2"),), limits, None),
        SetupSpec("echo hi", (("A", "1"),), Limits(**{**limits.__dict__, "pids": 64}), None),
        SetupSpec("echo hi", (("A", "1"),), limits, "strict"),
    ]
    assert len({base.key, *(o.key for o in others)}) == 5


def test_the_fleet_offers_every_session_call_of_the_single_client_with_its_parameters():
    """The verifier called `diff` on a SandboxFleet that lacked it (every episode of a main job
    with state_drift on ended as infra_verifier): the fleet stands in for SandboxClient, so every
    public coroutine of the client exists on the fleet with the same parameters."""
    import inspect

    from shellrl.clients.sandbox import SandboxClient

    def calls(cls):
        return {
            name: inspect.signature(fn)
            for name, fn in inspect.getmembers(cls, inspect.iscoroutinefunction)
            if not name.startswith("_")
        }

    client, fleet = calls(SandboxClient), calls(SandboxFleet)
    assert sorted(set(client) - set(fleet)) == []
    for name, signature in client.items():
        params = fleet[name].parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):  # forwards every keyword
            continue
        assert list(fleet[name].parameters) == list(signature.parameters), name
