"""An egress proxy under test in the running event loop, in front of an upstream that counts
connections: for scenarios that run in a network namespace with only loopback up
(tests/helpers/netns.py), where every address aimed at lands on the namespace's `lo`.

    async with ProxiedGets(redis_url, "addr", lambda port: [{"name": ..., "ports": [port]}]) as p:
        status = await p.get("cgnat.test")   # one GET through the proxy: the HTTP status (int)
        p.hits                               # local address of each connection the upstream took

The upstream listens on every address (both families) at one free port; the rules are built for
that port. The proxy audits to the Redis at `redis_url` (AuditLog)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.sandbox.egress.audit import AuditLog
from services.sandbox.egress.proxy import EgressProxy, EgressState, ProxyLimits
from services.sandbox.egress.rules import EgressPolicy
from tests.helpers.redis_server import free_port

REPLY_TIMEOUT_S = 20.0  # a hang guard: a proxied GET on loopback answers in milliseconds


class ProxiedGets:
    """EgressProxy (header timeout 5 s) under policy `name` with `rules(port)`, and the upstream."""

    def __init__(self, redis_url: str, name: str, rules: Callable[[int], list[dict]]) -> None:
        self.port = free_port()
        self.hits: list[str] = []
        self._state = EgressState(name, EgressPolicy.parse("t", {"rules": rules(self.port)}), _drop)
        self.proxy = EgressProxy(ProxyLimits(header_timeout_s=5.0), AuditLog(redis_url))
        self._servers: list[asyncio.Server] = []
        self._proxy_port = 0

    async def _upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hits.append(writer.get_extra_info("sockname")[0])
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> ProxiedGets:
        self._servers.append(await asyncio.start_server(self._upstream, None, self.port))
        proxy = await asyncio.start_server(
            lambda r, w: self.proxy.handle(self._state, r, w), "127.0.0.1", 0
        )
        self._servers.append(proxy)
        self._proxy_port = proxy.sockets[0].getsockname()[1]
        return self

    async def get(self, host: str) -> int:
        """GET http://{host}:{port}/x through the proxy; the answer's status code."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self._proxy_port)
        writer.write(f"GET http://{host}:{self.port}/x HTTP/1.1\r\nHost: h\r\n\r\n".encode())
        reply = await asyncio.wait_for(reader.read(), REPLY_TIMEOUT_S)
        writer.close()
        return int(reply.split(b" ", 2)[1])

    async def __aexit__(self, *exc: object) -> None:
        for server in reversed(self._servers):
            server.close()
        await self.proxy.audit.close()


def _drop(_event: object) -> None:
    """The egress state's event sink: the scenarios read the audit stream instead."""
