"""`AiohttpTransport` under httpx against real sockets: round trips through a real uvicorn app, and
every failure mapped to the httpx exception that keeps the clients' retry rules right (a request
that may have run is never re-sent; one that never left is retried)."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineUnavailable
from shellrl.clients.sandbox import SandboxClient, SandboxError
from shellrl.clients.transport import AiohttpTransport
from tests.fakes.fake_engine import serve_in_thread
from tests.helpers.redis_server import free_port


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {
            "body": await request.json(),
            "header": request.headers.get("x-demo"),
            "content_type": request.headers.get("content-type"),
        }

    @app.get("/missing")
    async def missing() -> Response:
        return Response(
            '{"error": {"code": "not_found"}}', status_code=404, media_type="application/json"
        )

    @app.get("/gzip")
    async def gzipped() -> Response:
        return Response(
            gzip.compress(b'{"ok": true}'),
            media_type="application/json",
            headers={"content-encoding": "gzip"},
        )

    return app


@pytest.fixture(scope="module")
def server():
    s = serve_in_thread(_app())
    try:
        yield s
    finally:
        s.stop()


class RawServer:
    """A real TCP server whose connection handler is a test's choice; counts requests received."""

    def __init__(self, handler) -> None:
        self.handler, self.requests, self.server = handler, 0, None

    async def __aenter__(self) -> RawServer:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                self.requests += 1
                await self.handler(writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def _close_without_answer(writer: asyncio.StreamWriter) -> None:
    pass  # the request was read (it may have run); the connection closes with no response


async def _never_answer(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


async def test_round_trips_keep_body_headers_status_and_decode_gzip(server):
    async with httpx.AsyncClient(transport=AiohttpTransport(), base_url=server.url) as client:
        response = await client.post("/echo", json={"a": [1, 2]}, headers={"x-demo": "yes"})
        assert response.status_code == 200
        assert response.json() == {
            "body": {"a": [1, 2]},
            "header": "yes",
            "content_type": "application/json",
        }
        missing = await client.get("/missing")
        assert missing.status_code == 404 and missing.json() == {"error": {"code": "not_found"}}
        assert (await client.get("/gzip")).json() == {"ok": True}
        many = await asyncio.gather(*(client.post("/echo", json=i) for i in range(50)))
        assert [r.json()["body"] for r in many] == list(range(50))


async def test_refused_connection_is_connect_error_and_the_engine_client_retries_it():
    url = f"http://127.0.0.1:{free_port()}"
    async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url + "/x")
    async with EngineClient([url], connect_retries=2, retry_backoff_s=0.01) as engine:
        with pytest.raises(EngineUnavailable, match="cannot connect"):
            await engine.generate([1, 2], {"max_new_tokens": 1})


async def test_a_connection_closed_after_the_request_is_remote_protocol_error_and_never_resent():
    """The case httpx-aiohttp 0.2.0 maps to ConnectTimeout, which would make EngineClient send the
    generate again although the server had it."""
    async with RawServer(_close_without_answer) as raw:
        async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post(raw.url + "/generate", json={})
        assert raw.requests == 1
        async with EngineClient([raw.url], connect_retries=3, retry_backoff_s=0.01) as engine:
            with pytest.raises(EngineUnavailable, match="connection lost"):
                await engine.generate([1, 2], {"max_new_tokens": 1})
        assert raw.requests == 2  # exactly one more: not re-sent


async def test_no_answer_in_time_is_read_timeout_and_never_resent():
    async with RawServer(_never_answer) as raw:
        async with httpx.AsyncClient(
            transport=AiohttpTransport(), timeout=httpx.Timeout(0.3)
        ) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.get(raw.url + "/slow")
        async with EngineClient([raw.url], timeout_s=0.3, connect_retries=3) as engine:
            with pytest.raises(EngineUnavailable, match="no answer in time"):
                await engine.generate([1, 2], {"max_new_tokens": 1})
        assert raw.requests == 2
        async with SandboxClient(raw.url, timeout_s=0.3) as sandbox:
            with pytest.raises(SandboxError, match="ReadTimeout"):
                await sandbox.session_info("s-1")
        assert raw.requests == 3


async def test_waiting_past_the_connect_timeout_for_a_pooled_connection_is_connect_timeout():
    async with RawServer(_never_answer) as raw:
        transport = AiohttpTransport(max_connections=1)
        async with httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(5.0, connect=0.2, pool=0.0)
        ) as client:
            first = asyncio.create_task(client.get(raw.url + "/hold"))
            await asyncio.sleep(0.2)
            with pytest.raises(httpx.ConnectTimeout):
                await client.get(raw.url + "/second")
            first.cancel()
        assert raw.requests == 1


def test_negative_max_connections_is_refused():
    with pytest.raises(ValueError, match="max_connections"):
        AiohttpTransport(max_connections=-1)


def test_one_transport_serves_a_second_event_loop_after_the_first_closed(server):
    """A client kept across `asyncio.run` calls (CLI helpers do that) gets a new aiohttp session in
    the new loop instead of aiohttp's RuntimeError from the old loop's session."""
    client = httpx.AsyncClient(transport=AiohttpTransport(), base_url=server.url)

    async def call() -> int:
        return (await client.post("/echo", json=1)).status_code

    assert asyncio.run(call()) == 200
    assert asyncio.run(call()) == 200
    asyncio.run(client.aclose())
