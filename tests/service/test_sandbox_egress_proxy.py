"""The egress proxy (services/sandbox/egress/proxy.py) on its own, over TCP on loopback with a real
Redis audit stream and a real upstream: the per-session limits, fail-closed auditing and the
refusal of names that resolve to internal addresses. The sandbox around it: test_sandbox_egress.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import redis.asyncio as aioredis

from services.sandbox.egress.audit import AuditLog
from services.sandbox.egress.proxy import EgressProxy, EgressState, ProxyLimits
from services.sandbox.egress.rules import EgressPolicy
from shellrl.streams.keys import STREAM_EGRESS
from tests.helpers.redis_server import free_port

BODY = b"x" * 200


async def _upstream(reader, writer):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 200\r\nConnection: close\r\n\r\n" + BODY)
    await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def _proxy(redis_url: str, host: str, port: int, **limits):
    policy = EgressPolicy.parse(
        "test", {"rules": [{"name": "up", "host": host, "ports": [port]}], **limits}
    )
    events: list[dict] = []
    state = EgressState("sess1", policy, events.append)
    proxy = EgressProxy(ProxyLimits(header_timeout_s=2.0), AuditLog(redis_url))
    server = await asyncio.start_server(
        lambda r, w: proxy.handle(state, r, w), "127.0.0.1", 0, limit=4096
    )
    try:
        yield server.sockets[0].getsockname()[1], state, events
    finally:
        server.close()
        await proxy.audit.close()


async def _get(proxy_port: int, url: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
    writer.write(f"GET {url} HTTP/1.1\r\nHost: ignored\r\n\r\n".encode())
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return int(reply.split(b" ", 2)[1]), reply


@pytest.fixture
async def upstream_port():
    server = await asyncio.start_server(_upstream, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _audit(redis_url: str) -> list[dict]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return [fields for _, fields in await client.xrange(STREAM_EGRESS)]
    finally:
        await client.aclose()


async def test_rate_limit_refuses_with_429_and_audits_it(redis_server, upstream_port):
    url = f"http://127.0.0.1:{upstream_port}/"
    async with _proxy(redis_server.url, "127.0.0.1", upstream_port, requests_per_minute=2) as (
        port,
        state,
        events,
    ):
        statuses = [(await _get(port, url))[0] for _ in range(3)]
    assert statuses == [200, 200, 429]
    assert [e["rule"] for e in events] == ["egress_rate_limit"]
    entries = await _audit(redis_server.url)
    assert [(e["phase"], e["verdict"], e["reason"]) for e in entries] == [
        ("decision", "allow", "rule"),
        ("closed", "allow", "rule"),
        ("decision", "allow", "rule"),
        ("closed", "allow", "rule"),
        ("decision", "deny", "rate_limit"),
    ]
    assert state.summary()["allow"] == 2 and state.summary()["deny"] == 1


async def test_byte_budget_cuts_the_transfer_and_refuses_the_next_request(
    redis_server, upstream_port
):
    url = f"http://127.0.0.1:{upstream_port}/"
    async with _proxy(redis_server.url, "127.0.0.1", upstream_port, max_bytes=250) as (
        port,
        state,
        _,
    ):
        status, reply = await _get(port, url)
        assert status == 200 and len(reply) < 250  # the head went up, then the budget ended
        assert state.bytes_used == 250
        assert (await _get(port, url))[0] == 429
    closed = [e for e in await _audit(redis_server.url) if e["phase"] == "closed"]
    assert int(closed[0]["bytes_sent"]) + int(closed[0]["bytes_received"]) <= 250


async def test_unwritable_audit_log_refuses_allowed_requests(upstream_port):
    seen = []

    async def upstream(reader, writer):
        seen.append(1)
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    async with _proxy(dead_redis, "127.0.0.1", target) as (port, _, _):
        status, reply = await _get(port, f"http://127.0.0.1:{target}/")
    server.close()
    assert status == 503 and b"audit_unavailable" in reply and not seen


async def test_a_name_resolving_to_an_internal_address_is_refused(redis_server, upstream_port):
    name = socket.gethostname()
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(name, upstream_port)}
    except OSError:
        pytest.skip(f"this machine's host name {name!r} does not resolve")
    if not any(a.startswith(("127.", "10.", "172.", "192.168.")) or a == "::1" for a in resolved):
        pytest.skip(f"{name!r} resolves to public addresses {resolved}")
    async with _proxy(redis_server.url, name, upstream_port) as (port, _, events):
        status, reply = await _get(port, f"http://{name}:{upstream_port}/")
    assert status == 403 and b"egress_internal_address" in reply
    assert [e["rule"] for e in events] == ["egress_internal_address"]
