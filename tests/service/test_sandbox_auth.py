"""The sandbox behind the stack's token (issue 17 item 8): a caller without it drives no session,
commands never see it, and a policy that shares the host network (loopback services included) is
usable only where the operator enabled it."""

from __future__ import annotations

import httpx
import pytest

from shellrl.clients.sandbox import SandboxBadRequest, SandboxClient
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port

TOKEN = "sandbox-token-0123456789abcdef"


def test_no_route_but_the_probes_serves_a_caller_without_the_token(sandbox_services):
    sandbox = sandbox_services.get("bubblewrap", api_token=TOKEN)
    with httpx.Client(base_url=sandbox.url, timeout=30) as anyone:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert anyone.get(path).status_code == 200, path
        for method, path in (
            ("POST", "/v1/sessions"),
            ("POST", "/v1/sessions/s1/exec"),
            ("GET", "/v1/sessions/s1/files/a.txt"),
            ("GET", "/v1/sessions/s1"),
            ("POST", "/v1/sessions/s1/reset"),
            ("POST", "/v1/sessions/s1/kill"),
            ("DELETE", "/v1/sessions/s1"),
            ("GET", "/v1/config"),
        ):
            refused = anyone.request(method, path, json={"setup": "", "command": "id"})
            assert refused.status_code == 401, (method, path)
            assert refused.json()["error"]["field"] == "Authorization"


async def test_the_network_policy_is_a_403_naming_policy_and_commands_never_see_the_token(
    sandbox_services,
):
    sandbox = sandbox_services.get("bubblewrap", api_token=TOKEN)
    async with SandboxClient(sandbox.url, api_token=TOKEN) as client:
        with pytest.raises(SandboxBadRequest) as refused:
            await client.create_session(policy="network")
        assert refused.value.status == 403 and refused.value.field == "policy"
        assert refused.value.code == "network_policy_disabled"
        session = await client.create_session(setup="echo hi > a.txt")
        try:
            seen = await client.exec(session["session_id"], "env; cat /proc/1/environ || true")
            assert TOKEN not in seen.stdout and "SHELLRL_API" not in seen.stdout
        finally:
            await client.delete(session["session_id"])


async def test_an_operator_who_enables_network_policies_gets_them(sandbox_services):
    sandbox = sandbox_services.get("bubblewrap", api_token=TOKEN, allow_network_policies="true")
    async with SandboxClient(sandbox.url, api_token=TOKEN) as client:
        session = await client.create_session(policy="network")
        await client.delete(session["session_id"])
    assert session["policy"] == "network"


def test_a_network_default_policy_without_the_operator_s_consent_fails_at_start_up(tmp_path):
    env = {"SHELLRL_API_TOKEN": TOKEN, "SHELLRL_DEFAULT_POLICY": "network"}
    proc = ServiceProcess("sandbox", free_port(), env, tmp_path)
    with pytest.raises(RuntimeError, match="SHELLRL_ALLOW_NETWORK_POLICIES=true"):
        proc.start(ready_timeout_s=60)
