"""The sandbox's egress proxy against a real sandbox service (bubblewrap), a real Redis and a
loopback HTTP server of the test: allowed requests go through, denied ones get 403 and an audit
entry, direct connections fail, hostile input does not take the proxy down."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

from shellrl.clients.sandbox import SandboxClient
from shellrl.streams.keys import STREAM_EGRESS

HEADER_TIMEOUT_S = 1.0


class _Handler(BaseHTTPRequestHandler):
    paths: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.paths.append(self.path)
        body = b"hello from the host\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def service(sandbox_services, module_redis_server, upstream, tmp_path_factory):
    port = upstream.server_address[1]
    policy_file = tmp_path_factory.mktemp("egress") / "policies.yaml"
    policy_file.write_text(
        f"""
policies:
  default:
    rules: []
  egress:
    egress:
      requests_per_minute: 600
      rules:
        - name: upstream_ok
          host: 127.0.0.1
          ports: [{port}]
          methods: [GET, HEAD, CONNECT]
          path_prefix: /ok
"""
    )
    return sandbox_services.get(
        "bubblewrap",
        policy_file=str(policy_file),
        redis_url=module_redis_server.url,
        egress_header_timeout_s=str(HEADER_TIMEOUT_S),
    )


@pytest.fixture
async def session(service):
    async with SandboxClient(service.url, timeout_s=30) as client:
        created = await client.create_session(policy="egress")
        yield client, created["session_id"]
        await client.delete(created["session_id"])


def _audit(redis_url: str) -> list[dict[str, str]]:
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        return [fields for _, fields in r.xrange(STREAM_EGRESS)]


async def test_allowed_request_reaches_the_loopback_server_through_the_proxy(
    session, upstream, module_redis_server
):
    client, sid = session
    port = upstream.server_address[1]
    result = await client.exec(sid, f"curl -sS --max-time 5 http://127.0.0.1:{port}/ok/a")
    assert (result.exit_code, result.stdout) == (0, "hello from the host\n"), result.stderr
    script = (
        "import urllib.request;"
        f"print(urllib.request.urlopen('http://127.0.0.1:{port}/ok/b', timeout=5).read().decode())"
    )
    result = await client.exec(sid, f'python3 -c "{script}"')
    assert result.stdout == "hello from the host\n\n", result.stderr
    # CONNECT (what HTTPS uses) through the same rule: curl tunnels plain HTTP with -p
    result = await client.exec(sid, f"curl -sS -p --max-time 5 http://127.0.0.1:{port}/ok/c")
    assert result.stdout == "hello from the host\n", result.stderr
    assert {"/ok/a", "/ok/b", "/ok/c"} <= set(_Handler.paths)
    mine = [e for e in _audit(module_redis_server.url) if e["session_id"] == sid]
    closed = [e for e in mine if e["phase"] == "closed"]
    assert [e["path"] for e in closed] == ["/ok/a", "/ok/b", ""]
    assert all(e["verdict"] == "allow" and e["rule"] == "upstream_ok" for e in mine)
    assert all(int(e["bytes_received"]) > 0 and int(e["bytes_sent"]) > 0 for e in closed)
    info = await client.session_info(sid)
    assert info["safety_events"] == [] and info["egress"]["allow"] == 3


async def test_denied_request_gets_403_from_the_proxy_and_an_audit_entry(
    session, upstream, module_redis_server
):
    client, sid = session
    port = upstream.server_address[1]
    result = await client.exec(
        sid, f"curl -sS --max-time 5 -w '\\n%{{http_code}}' http://127.0.0.1:{port}/secret"
    )
    body, status = result.stdout.rsplit("\n", 1)
    assert status == "403"
    assert json.loads(body)["error"]["code"] == "egress_no_rule"
    assert "/secret" not in _Handler.paths
    denied = [
        e
        for e in _audit(module_redis_server.url)
        if e["session_id"] == sid and e["verdict"] == "deny"
    ]
    assert [(e["method"], e["host"], e["port"], e["path"]) for e in denied] == [
        ("GET", "127.0.0.1", str(port), "/secret")
    ]
    assert denied[0]["reason"] == "no_rule" and denied[0]["rule"] == ""
    info = await client.session_info(sid)
    assert [e["rule"] for e in info["safety_events"]] == ["egress_no_rule"]


async def test_direct_connections_and_dns_fail_and_redis_stays_unreachable(
    session, upstream, module_redis_server
):
    client, sid = session
    port, redis_port = upstream.server_address[1], module_redis_server.port
    for target in (port, redis_port):
        result = await client.exec(
            sid, f"timeout 3 bash -c 'echo hi > /dev/tcp/127.0.0.1/{target}'"
        )
        assert result.exit_code != 0
        script = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {target}), timeout=2); print('OPEN')\n"
            "except OSError as e:\n    print('refused', e.errno)"
        )
        result = await client.exec(sid, f'python3 -c "{script}"')
        assert result.stdout.startswith("refused"), result.stdout
    script = (
        "import socket\ntry:\n    print(socket.getaddrinfo('example.com', 80))\n"
        "except OSError as e:\n    print('no dns', e.errno)"
    )
    result = await client.exec(sid, f'timeout 5 python3 -c "{script}"')
    assert result.stdout.startswith("no dns"), result.stdout
    # through the proxy: no rule names the Redis port (CONNECT and plain HTTP alike)
    result = await client.exec(
        sid, f"curl -sS -p --max-time 5 -o /dev/null http://127.0.0.1:{redis_port}/ 2>&1"
    )
    assert "403" in result.stdout, result.stdout
    result = await client.exec(
        sid,
        f"curl -sS --max-time 5 -w '%{{http_code}}' -o /dev/null http://localhost:{redis_port}/",
    )
    assert result.stdout == "403"


HOSTILE = r"""
import socket, time, os
def talk(data, delay_s=0.0, door=("127.0.0.1", 3128)):
    s = socket.create_connection(door, timeout=10)
    for i in range(0, len(data), 1 if delay_s else len(data)):
        try:
            s.sendall(data[i:i + (1 if delay_s else len(data))])
        except OSError:
            break
        time.sleep(delay_s)
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    return reply.split(b"\r\n", 1)[0].decode()
print(talk(b"GET http://127.0.0.1:PORT/ok HTTP/1.1\r\n" + b"X-Big: " + b"a" * 200000 + b"\r\n\r\n"))
start = time.monotonic()
print(talk(b"GET http://127.0.0.1:PORT/ok HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n\r\n", 0.1),
      round(time.monotonic() - start))
print(talk(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n"))
print(talk(b"\x16\x03\x01garbage\r\n\r\n"))
print(talk(b"GET http://127.0.0.1:PORT/ok/../secret HTTP/1.1\r\n\r\n"))
unix = socket.socket(socket.AF_UNIX)
unix.connect(os.environ["SHELLRL_EGRESS_SOCKET"])
unix.sendall(b"GET http://127.0.0.1:PORT/ok/unix HTTP/1.1\r\nHost: x\r\n\r\n")
print(unix.recv(65536).split(b"\r\n", 1)[0].decode())
"""


async def test_proxy_survives_huge_headers_slowloris_and_denied_connect(session, upstream):
    client, sid = session
    port = upstream.server_address[1]
    await client.exec(sid, f"cat > hostile.py <<'EOF'\n{HOSTILE.replace('PORT', str(port))}EOF")
    result = await client.exec(sid, "python3 hostile.py", timeout_s=20)
    lines = result.stdout.splitlines()
    assert len(lines) == 6, result.stdout + result.stderr
    assert lines[0] == "HTTP/1.1 431 Request Header Fields Too Large", result.stderr
    slow, slow_s = lines[1].rsplit(" ", 1)
    # the 1 s header timeout; the slow headers themselves take 6 s (a timeout per read: 200 OK)
    assert slow == "HTTP/1.1 408 Request Timeout" and int(slow_s) <= HEADER_TIMEOUT_S + 3
    assert lines[2] == "HTTP/1.1 403 Forbidden"
    assert lines[3] == "HTTP/1.1 400 Bad Request"
    assert lines[4] == "HTTP/1.1 400 Bad Request"
    assert lines[5].endswith(" 200 OK")  # the Unix socket door, and the proxy still serves
    assert "/ok/unix" in _Handler.paths and "/secret" not in _Handler.paths
    result = await client.exec(sid, f"curl -sS --max-time 5 http://127.0.0.1:{port}/ok/after")
    assert result.stdout == "hello from the host\n"


async def test_proxy_door_survives_a_reset_and_a_kill_of_the_sessions_processes(session, upstream):
    client, sid = session
    port = upstream.server_address[1]
    await client.reset(sid)
    await client.kill_processes(sid)
    result = await client.exec(sid, f"curl -sS --max-time 5 http://127.0.0.1:{port}/ok/reset")
    assert result.stdout == "hello from the host\n", result.stderr


async def test_session_without_egress_rules_has_no_proxy(service):
    async with SandboxClient(service.url, timeout_s=30) as client:
        sid = (await client.create_session())["session_id"]
        result = await client.exec(sid, "env | grep -ci proxy; ls /run/shellrl")
        assert result.stdout.splitlines()[0] == "0" and "egress.sock" not in result.stdout
        await client.delete(sid)
