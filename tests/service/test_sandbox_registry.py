"""Sandbox services that register themselves in `shellrl:sandboxes` (services/sandbox/
registration.py) and a SandboxFleet that reads the registry (shellrl/clients/sandbox_fleet.py):
a service that joins takes new sessions, another fleet (the verifier's) routes to it by id, and
one that stops takes no new session."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from shellrl.clients.sandbox import SandboxBusy
from shellrl.clients.sandbox_fleet import SandboxFleet
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until_async


@pytest.fixture
def registering(redis_server, tmp_path):
    """`start()` -> a running sandbox service that registers itself at redis_server."""
    started: list[ServiceProcess] = []
    root = tempfile.mkdtemp(prefix="shellrl-sandbox-registry-")
    os.chmod(root, 0o711)

    def start() -> ServiceProcess:
        port = free_port()
        env = {
            "SHELLRL_WORKSPACE_ROOT": f"{root}/{port}",
            "SHELLRL_REDIS_URL": redis_server.url,
            "SHELLRL_SANDBOX_REGISTER_URL": f"http://127.0.0.1:{port}",
            "SHELLRL_SANDBOX_REGISTER_HEARTBEAT_S": "0.5",
        }
        started.append(ServiceProcess("sandbox", port, env, tmp_path).start())
        return started[-1]

    yield start
    for service in started:
        service.stop()
    shutil.rmtree(root, ignore_errors=True)


async def test_registered_services_join_the_fleet_are_routed_to_and_leave_it(
    redis_server, registering
):
    async with (
        SandboxFleet("", registry_url=redis_server.url, refresh_s=0.0) as fleet,
        SandboxFleet("", registry_url=redis_server.url) as verifier_side,
    ):
        with pytest.raises(SandboxBusy):  # nothing registered yet: wait, not fail
            await fleet.create_session()
        first = registering()

        async def created() -> dict | None:
            try:
                return await fleet.create_session()
            except SandboxBusy:
                return None

        a = await wait_until_async(created, 10.0, "the first registration")
        assert a["sandbox_url"] == first.url
        second = registering()

        async def on_second() -> dict | None:
            session = await fleet.create_session(setup="echo b > b.txt")
            if session["sandbox_url"] == second.url:
                return session
            await fleet.delete(session["session_id"])
            return None

        b = await wait_until_async(on_second, 10.0, "a session on the service that joined")
        result = await verifier_side.exec(b["session_id"], "cat b.txt")  # another fleet routes it
        assert result.stdout == "b\n"
        await verifier_side.delete(b["session_id"])
        second.stop()  # SIGTERM: its registration is deleted

        async def second_gone() -> bool:
            session = await fleet.create_session()  # each create reads the registry (refresh_s 0)
            await fleet.delete(session["session_id"])
            return any(m["gone"] for m in fleet.status()["members"] if m["url"] == second.url)

        await wait_until_async(second_gone, 10.0, "the stopped member gone")
        for _ in range(3):
            session = await fleet.create_session()
            assert session["sandbox_url"] == first.url
            await fleet.delete(session["session_id"])
        await fleet.delete(a["session_id"])
