"""HTTP conventions: probes, and every error as {"error": {"code", "message", "field"}}."""

from __future__ import annotations

import httpx
from pydantic import BaseModel, Field

from shellrl.service.app import ApiError, create_app


class FileRef(BaseModel):
    path: str = Field(min_length=1)


class Body(BaseModel):
    command: str
    files: list[FileRef] = []
    timeout_s: float = Field(10, gt=0)


def _client(ready: dict | None = None) -> httpx.AsyncClient:
    async def ready_check():
        return ready if ready is not None else {"ready": True}

    app = create_app("demo", {"port": 1}, ready_check=ready_check)

    @app.post("/v1/things")
    async def make_thing(body: Body) -> dict:
        if body.command == "taken":
            raise ApiError(409, "conflict", "a thing with this command exists", field="command")
        if body.command == "boom":
            raise RuntimeError("disk on fire")
        return {"ok": True}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://demo")


def _assert_error(resp: httpx.Response, status: int, code: str, field: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (
        err["code"] == code
        and err["field"] == field
        and isinstance(err["message"], str)
        and err["message"]
    )
    return err


async def test_probes_and_config():
    async with _client() as c:
        assert (await c.get("/healthz")).json() == {"status": "ok", "service": "demo"}
        assert (await c.get("/readyz")).status_code == 200
        assert (await c.get("/v1/config")).json() == {"port": 1}
        metrics = await c.get("/metrics")
        assert metrics.status_code == 200 and "text/plain" in metrics.headers["content-type"]


async def test_not_ready_is_503_with_details():
    async with _client({"ready": False, "redis": "down"}) as c:
        resp = await c.get("/readyz")
    assert resp.status_code == 503 and resp.json()["redis"] == "down"


async def test_api_error_keeps_status_code_and_field():
    async with _client() as c:
        _assert_error(
            await c.post("/v1/things", json={"command": "taken"}), 409, "conflict", "command"
        )


async def test_validation_error_names_the_field():
    async with _client() as c:
        _assert_error(await c.post("/v1/things", json={}), 422, "invalid_request", "command")
        _assert_error(
            await c.post("/v1/things", json={"command": "x", "timeout_s": -1}),
            422,
            "invalid_request",
            "timeout_s",
        )


async def test_a_body_field_called_path_is_named_not_swallowed():
    async with _client() as c:
        err = _assert_error(
            await c.post("/v1/things", json={"command": "x", "files": [{"path": ""}]}),
            422,
            "invalid_request",
            "files[0].path",
        )
    assert err["details"][0]["field"] == "files[0].path"


async def test_malformed_json_body_is_422_without_a_bogus_field():
    async with _client() as c:
        resp = await c.post(
            "/v1/things", content=b'{"command": ', headers={"content-type": "application/json"}
        )
    _assert_error(resp, 422, "invalid_request", None)


async def test_unknown_route_and_wrong_method_use_the_error_format():
    async with _client() as c:
        _assert_error(await c.get("/v1/nothing"), 404, "not_found", None)
        _assert_error(await c.get("/v1/things"), 405, "method_not_allowed", None)


async def test_unhandled_exception_is_500_in_the_error_format():
    async with _client() as c:
        err = _assert_error(
            await c.post("/v1/things", json={"command": "boom"}), 500, "internal", None
        )
    assert "disk on fire" in err["message"]


def test_a_500_keeps_the_kept_alive_connection_usable_over_real_http():
    """Over a real uvicorn server: after an unhandled error the next request on the same
    connection succeeds (Starlette's own 500 path re-raised and uvicorn dropped the connection
    without `Connection: close`, so the client's next request failed; issue 17 item 1)."""
    import socket
    import threading
    import time

    import uvicorn

    app = create_app("demo", {"port": 1})

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("disk on fire")

    @app.get("/fine")
    async def fine() -> dict:
        return {"ok": True}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        peers = []
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", limits=httpx.Limits(max_connections=1)
        ) as c:
            for path, status in (("/boom", 500), ("/fine", 200), ("/boom", 500), ("/fine", 200)):
                response = c.get(
                    path,
                    extensions={
                        "trace": lambda name, info: (
                            peers.append(info["return_value"].get_extra_info("client_addr"))
                            if name == "connection.connect_tcp.complete"
                            else None
                        )
                    },
                )
                assert response.status_code == status
                assert response.headers.get("connection") != "close"
        assert len(peers) == 1, f"one TCP connection for all four requests, got {peers}"
    finally:
        server.should_exit = True
        thread.join(10)
