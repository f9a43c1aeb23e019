"""Two stacks on one machine (issue 34 item 2): `shellrl up --port-offset N` moves every port of
a stack, so a second one runs beside the first. Each stack here is Redis, a sandbox and a verifier
(the services that need no model: the cheapest stack that starts services of their own ports and
wires one to the other); each answers on its own ports with its own token and Redis, and both stop
without leaving a port taken."""

from __future__ import annotations

import dataclasses
import socket

import httpx
import pytest

from cli.commands import up as up_command
from cli.launcher import Stack
from cli.main import parse
from cli.stack_config import DEFAULT_PORTS, port_is_free
from tests.helpers.owned_processes import adopt_stack
from tests.helpers.port_offsets import free_port_offsets

pytestmark = pytest.mark.slow

SERVICES = ("sandbox", "verifier")


def redis_answers(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


def test_two_stacks_with_port_offsets_answer_each_on_its_own_ports(tmp_path):
    stacks = []
    try:
        for offset in free_port_offsets(2, SERVICES):
            state = tmp_path / f"stack-{offset}"
            state.mkdir()
            state.chmod(0o755)  # the sandbox's workspace root must be traversable by other uids
            argv = ["up", "--model-path", "tiny", "--quiet", "--state-dir", str(state)]
            args = parse([*argv, "--port-offset", str(offset)])
            config = up_command.stack_config(args)
            config = dataclasses.replace(config, services=SERVICES, ready_timeout_s=120)
            stack = Stack(config)
            stacks.append((offset, stack))
            stack.start()
            adopt_stack(stack)
        (offset_a, a), (offset_b, b) = stacks
        for offset, stack in stacks:
            ports = stack.config.ports
            assert redis_answers(DEFAULT_PORTS["redis"] + offset)
            for name in SERVICES:
                assert ports[name] == DEFAULT_PORTS[name] + offset
                url = f"http://127.0.0.1:{DEFAULT_PORTS[name] + offset}"
                config = httpx.get(
                    f"{url}/v1/config", headers=stack.config.auth_headers(), timeout=10
                ).json()
                assert config["port"] == ports[name]
                assert config["redis_url"] == stack.config.redis_url
            verifier = httpx.get(
                f"{stack.config.url('verifier')}/v1/config",
                headers=stack.config.auth_headers(),
                timeout=10,
            ).json()
            assert verifier["sandbox_url"] == stack.config.url("sandbox")
        refused = httpx.get(
            f"{b.config.url('verifier')}/v1/config", headers=a.config.auth_headers(), timeout=10
        )
        assert refused.status_code == 401  # the other stack's token: two stacks, not one
    finally:
        for _, stack in reversed(stacks):
            stack.stop()
    for offset, _ in stacks:
        assert all(port_is_free(DEFAULT_PORTS[n] + offset) for n in ("redis", *SERVICES))
