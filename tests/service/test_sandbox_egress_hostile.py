"""Issue 32 item 6, the proxy half: what a session that wants out would send the egress proxy
(services/sandbox/egress/) next, past the inputs of test_sandbox_egress_smuggling.py: path
tricks that other servers read as another path, a Host header or a URL that names another host
than the one checked, an origin-form request, `Expect: 100-continue` and an `Upgrade` to turn a
checked request into something else, and names that resolve differently on a second lookup or to
a global and an internal address at once. Each against the real proxy over TCP on loopback, a
real Redis audit stream and an upstream that keeps every byte it receives; the names in a network
namespace with only loopback up (tests/helpers/netns.py). The sandbox half:
test_sandbox_hostile.py; both listed in README.md, Security (sandbox)."""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest
import redis.asyncio as aioredis

from services.sandbox.egress.audit import AuditLog
from services.sandbox.egress.proxy import EgressProxy, EgressState, ProxyLimits
from services.sandbox.egress.rules import EgressPolicy
from shellrl.streams.keys import STREAM_EGRESS
from tests.helpers.egress_proxy import ProxiedGets
from tests.helpers.netns import run_isolated
from tests.helpers.redis_server import RedisServer

REPLY_TIMEOUT_S = 8.0
SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


@dataclass
class Upstream:
    """An HTTP server that keeps every byte it receives and answers 200 (or, with `switch`, 101
    and then raw bytes, as a WebSocket server would)."""

    received: list[bytearray] = field(default_factory=list)
    switch: bool = False

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw = bytearray()
        self.received.append(raw)
        conn = h11.Connection(h11.SERVER)
        try:
            async with asyncio.timeout(10):
                while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        raw += data
                        conn.receive_data(data)
                if self.switch:
                    writer.write(SWITCH + b"RAW-TUNNEL-BYTES")
                else:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    )
                await writer.drain()
        except (h11.ProtocolError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()


@dataclass
class Proxy:
    port: int
    upstream: Upstream
    upstream_port: int
    redis_url: str
    session_id: str

    async def send(self, data: bytes) -> bytes:
        """Send `data` (PORT: the upstream's port), half-close, read the answer to its end."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(data.replace(b"PORT", str(self.upstream_port).encode()))
            await writer.drain()
            writer.write_eof()
            return await asyncio.wait_for(reader.read(), REPLY_TIMEOUT_S)
        finally:
            writer.close()

    async def decisions(self) -> list[dict]:
        client = aioredis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            entries = [fields for _, fields in await client.xrange(STREAM_EGRESS)]
        finally:
            await client.aclose()
        return [
            e for e in entries if e["session_id"] == self.session_id and e["phase"] == "decision"
        ]


@pytest.fixture
async def proxy(module_redis_server):
    upstream = Upstream()
    up_server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    up_port = up_server.sockets[0].getsockname()[1]
    rules = [
        {"name": "ok", "host": "127.0.0.1", "ports": [up_port], "methods": ["GET", "POST"]},
    ]
    rules[0]["path_prefix"] = "/ok"
    sid = f"hostile-{secrets.token_hex(6)}"  # one module Redis for all tests
    state = EgressState(sid, EgressPolicy.parse("t", {"rules": rules}), lambda event: None)
    egress = EgressProxy(
        ProxyLimits(header_timeout_s=2.0, idle_timeout_s=3.0), AuditLog(module_redis_server.url)
    )
    server = await asyncio.start_server(lambda r, w: egress.handle(state, r, w), "127.0.0.1", 0)
    yield Proxy(server.sockets[0].getsockname()[1], upstream, up_port, module_redis_server.url, sid)
    server.close()
    up_server.close()
    await egress.audit.close()


def _status(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply
    return int(reply.split(b" ", 2)[1])


def _error_code(reply: bytes) -> str:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"]


@pytest.mark.parametrize(
    "path", ["/ok/..;/secret", "/ok/%2e%2e;x/secret", "/ok/.;/../secret", "/ok/..%3b/secret"]
)
async def test_a_dot_segment_with_path_parameters_is_refused_not_forwarded(proxy, path):
    """`/ok/..;/secret` matched the rule's `/ok` and went upstream as it was: Tomcat, Jetty and
    Spring drop `;x` from a segment and serve `/secret`."""
    reply = await proxy.send(
        f"GET http://127.0.0.1:PORT{path} HTTP/1.1\r\nHost: h\r\n\r\n".encode()
    )
    assert _status(reply) == 400 and _error_code(reply) == "bad_path", reply
    assert proxy.upstream.received == []
    (decision,) = await proxy.decisions()
    assert (decision["verdict"], decision["reason"]) == ("refused", "bad_path")


async def test_a_path_prefix_covers_whole_segments_only(proxy):
    """A rule's `path_prefix: /ok` allowed `/okay/secret` and `/ok-admin` (a string prefix)."""
    statuses = {}
    for path in ("/ok", "/ok/a", "/ok?q=/x", "/okay/secret", "/ok-admin", "/ok;/secret"):
        reply = await proxy.send(
            f"GET http://127.0.0.1:PORT{path} HTTP/1.1\r\nHost: h\r\n\r\n".encode()
        )
        statuses[path] = _status(reply)
    assert statuses == {
        "/ok": 200,
        "/ok/a": 200,
        "/ok?q=/x": 200,
        "/okay/secret": 403,
        "/ok-admin": 403,
        "/ok;/secret": 403,
    }
    forwarded = [bytes(raw).split(b" ", 2)[1] for raw in proxy.upstream.received]
    assert forwarded == [b"/ok", b"/ok/a", b"/ok?q=/x"]


async def test_a_host_header_naming_another_host_never_reaches_the_upstream(proxy):
    reply = await proxy.send(
        b"GET http://127.0.0.1:PORT/ok/h HTTP/1.1\r\nHost: redis.internal:6379\r\n"
        b"X-Forwarded-Host: redis.internal\r\n\r\n"
    )
    assert _status(reply) == 200
    (raw,) = proxy.upstream.received
    head = bytes(raw).split(b"\r\n\r\n")[0].lower()
    assert head.count(b"\r\nhost: ") == 1
    assert f"\r\nhost: 127.0.0.1:{proxy.upstream_port}\r\n".encode() in head + b"\r\n"
    assert b"redis.internal:6379" not in head
    (decision,) = await proxy.decisions()
    assert (decision["host"], decision["port"]) == ("127.0.0.1", str(proxy.upstream_port))


async def test_an_origin_form_request_trusting_the_host_header_is_refused(proxy):
    reply = await proxy.send(b"GET /ok/x HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\n\r\n")
    assert _status(reply) == 400 and b"absolute http://" in reply
    assert proxy.upstream.received == []
    (decision,) = await proxy.decisions()
    assert decision["verdict"] == "refused"


@pytest.mark.parametrize(
    "target, status, audited_host",
    [
        ("http://127.0.0.1:PORT\\@10.0.0.1/ok/x", 400, ""),  # some parsers: host 10.0.0.1
        ("http://user:pw@10.0.0.1:PORT/ok/x", 400, ""),
        ("http://127.0.0.1:PORT#@10.0.0.1/ok/x", 403, "127.0.0.1"),  # path "/" (the fragment)
        ("http://10.0.0.1:PORT#@127.0.0.1:PORT/ok/x", 403, "10.0.0.1"),
    ],
)
async def test_a_url_whose_parsers_disagree_on_the_host_is_checked_as_it_is_connected(
    proxy, target, status, audited_host
):
    reply = await proxy.send(f"GET {target} HTTP/1.1\r\nHost: h\r\n\r\n".encode())
    assert _status(reply) == status, reply
    assert proxy.upstream.received == []
    (decision,) = await proxy.decisions()
    assert decision["host"] == audited_host


async def test_expect_100_continue_gets_no_100_before_the_verdict_and_never_goes_upstream(proxy):
    denied = await proxy.send(
        b"POST http://127.0.0.1:PORT/secret HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    assert denied.startswith(b"HTTP/1.1 403 ") and b"100 Continue" not in denied, denied
    assert proxy.upstream.received == []
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(
            b"POST http://127.0.0.1:%d/ok/p HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n"
            b"Expect: 100-continue\r\n\r\n" % proxy.upstream_port
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REPLY_TIMEOUT_S)
        assert interim == b"HTTP/1.1 100 \r\n\r\n", interim  # h11 writes no reason phrase
        writer.write(b"hello")
        writer.write_eof()
        reply = await asyncio.wait_for(reader.read(), REPLY_TIMEOUT_S)
    finally:
        writer.close()
    assert _status(reply) == 200
    (raw,) = proxy.upstream.received
    assert b"expect" not in bytes(raw).lower() and bytes(raw).endswith(b"\r\n\r\nhello")


async def test_an_upgrade_cannot_turn_a_checked_request_into_a_raw_tunnel(proxy):
    proxy.upstream.switch = True
    reply = await proxy.send(
        b"GET http://127.0.0.1:PORT/ok/ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\nRAW-FROM-CLIENT"
    )
    (raw,) = proxy.upstream.received
    head = bytes(raw).lower()
    assert b"upgrade" not in head and b"raw-from-client" not in head, raw
    assert _status(reply) == 502 and b"RAW-TUNNEL-BYTES" not in reply, reply


# -- names, in a network namespace with only loopback ---------------------------------------

GLOBAL, INTERNAL = "151.101.0.223", "100.64.0.1"  # both put on lo in the namespace


async def names_scenario(spec: dict) -> dict:
    """In the isolated namespace: `rebind.test` resolves to GLOBAL at the proxy's lookup and to
    INTERNAL on every later one (the hosts file is rewritten right after the first answer);
    `mixed.test` resolves to both at once. GET each through the proxy."""
    hosts = Path("/etc/hosts")
    mixed = f"{GLOBAL} mixed.test\n{INTERNAL} mixed.test\n"
    hosts.write_text(f"127.0.0.1 localhost\n{GLOBAL} rebind.test\n{mixed}")
    redis = RedisServer(Path(spec["tmp"]) / "redis").start()
    loop = asyncio.get_running_loop()
    real_getaddrinfo, lookups = loop.getaddrinfo, []

    async def rebinding_getaddrinfo(host, *args, **kwargs):
        infos = await real_getaddrinfo(host, *args, **kwargs)
        lookups.append([host, sorted({info[4][0] for info in infos})])
        if host == "rebind.test":
            hosts.write_text(f"127.0.0.1 localhost\n{INTERNAL} rebind.test\n{mixed}")
        return infos

    loop.getaddrinfo = rebinding_getaddrinfo
    rules = lambda port: [{"name": "names", "host": "*.test", "ports": [port]}]  # noqa: E731
    try:
        async with ProxiedGets(redis.url, "names", rules) as proxied:
            statuses = {host: await proxied.get(host) for host in ("rebind.test", "mixed.test")}
        later = await real_getaddrinfo("rebind.test", proxied.port)  # a second lookup's answer
        client = aioredis.Redis.from_url(redis.url, decode_responses=True)
        entries = [f for _, f in await client.xrange(STREAM_EGRESS) if f["phase"] == "decision"]
        await client.aclose()
    finally:
        redis.stop()
    return {
        "statuses": statuses,
        "hits": proxied.hits,
        "lookups": lookups,
        "later": sorted({info[4][0] for info in later}),
        "audit": {e["host"]: [e["verdict"], e["reason"]] for e in entries},
    }


@pytest.fixture(scope="module")
def names_result():
    return run_isolated(
        "tests.service.test_sandbox_egress_hostile:names_scenario",
        {},
        addresses=[f"{GLOBAL}/32", f"{INTERNAL}/32"],
    )


def test_a_name_that_rebinds_after_the_check_is_connected_at_the_checked_address(names_result):
    """DNS rebinding: a second lookup (the connect's) would answer the internal address."""
    assert names_result["later"] == [INTERNAL]  # the resolver really rebinds
    assert names_result["statuses"]["rebind.test"] == 200
    assert [host for host, _ in names_result["lookups"]].count("rebind.test") == 1
    assert names_result["hits"] == [GLOBAL]  # never INTERNAL
    assert names_result["audit"]["rebind.test"] == ["allow", "rule"]


def test_a_name_with_a_global_and_an_internal_address_is_refused(names_result):
    assert ["mixed.test", sorted([GLOBAL, INTERNAL])] in names_result["lookups"]
    assert names_result["statuses"]["mixed.test"] == 403
    assert names_result["audit"]["mixed.test"] == ["deny", "internal_address"]
