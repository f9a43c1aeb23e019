"""The stack's bearer token (issue 17 item 8): every route but the probes and the API description
needs it, the settings take it from one place and never show it, a service without one does not
start, the launcher hands a fresh one over in a file only its user reads, clients send it."""

from __future__ import annotations

import os
import stat
import sys

import httpx
import pytest
from pydantic import ValidationError

from cli.launcher import Stack
from cli.stack_config import StackConfig, api_headers
from shellrl.clients.sandbox import SandboxBadRequest, SandboxClient
from shellrl.service.app import create_app
from shellrl.service.auth import OPEN_PATHS, new_token
from shellrl.service.settings import ServiceSettings
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO

TOKEN = "test-token-0123456789abcdef"


def _client(token: str | None = TOKEN, headers: dict | None = None) -> httpx.AsyncClient:
    app = create_app("demo", {"port": 1}, api_token=token)

    @app.post("/v1/things")
    async def make_thing() -> dict:
        return {"made": True}

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str) -> dict:
        return {"session_id": session_id}

    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://demo", headers=headers)


async def test_every_route_but_the_probes_needs_the_bearer_token():
    async with _client() as anyone, _client(headers={"Authorization": f"Bearer {TOKEN}"}) as ok:
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert (await anyone.get(path)).status_code == 200, path
        for method, path in (
            ("POST", "/v1/things"),
            ("GET", "/v1/sessions/s1"),
            ("GET", "/v1/config"),
        ):
            refused = await anyone.request(method, path)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith(
                "Bearer"
            )
            assert refused.json()["error"] == {
                "code": "unauthorized",
                "message": "missing 'Authorization: Bearer <token>' header",
                "field": "Authorization",
            }
            assert (await ok.request(method, path)).status_code == 200, path
        assert (await anyone.post("/nowhere")).status_code == 401  # nothing to learn about routes


@pytest.mark.parametrize(
    "header",
    [f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN, "Bearer ", "Bearer"],
)
async def test_a_wrong_or_malformed_token_is_a_401_naming_the_header(header):
    async with _client(headers={"Authorization": header}) as client:
        refused = await client.post("/v1/things")
    assert refused.status_code == 401 and refused.json()["error"]["field"] == "Authorization"


async def test_without_a_token_every_route_is_open_and_the_document_has_no_security():
    async with _client(token=None) as client:
        assert (await client.post("/v1/things")).status_code == 200
        doc = (await client.get("/openapi.json")).json()
    assert "securitySchemes" not in doc["components"]


async def test_the_openapi_document_names_the_scheme_and_a_401_on_every_protected_route():
    async with _client() as client:
        doc = (await client.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the stack's API token",
    }
    for path, item in doc["paths"].items():
        for operation in item.values():
            protected = path not in OPEN_PATHS
            assert ("401" in operation["responses"]) is protected, path
            assert (operation.get("security") == [{"bearer": []}]) is protected, path
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # 422s are ErrorBody
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def test_settings_take_one_token_source_and_never_show_it(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.upper().startswith("SHELLRL_")]:
        monkeypatch.delenv(name)
    settings = ServiceSettings(api_token=TOKEN)
    assert settings.api_token_value() == TOKEN
    assert settings.public_dict()["api_token"] == "**********" and TOKEN not in repr(settings)
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert ServiceSettings(api_token_file=path).api_token_value() == TOKEN
    assert ServiceSettings().api_token_value() is None
    with pytest.raises(ValidationError, match="api_token and api_token_file: give one"):
        ServiceSettings(api_token=TOKEN, api_token_file=path)
    with pytest.raises(ValidationError, match="api_token and auth_disabled: give one"):
        ServiceSettings(api_token=TOKEN, auth_disabled=True)
    with pytest.raises(ValidationError, match="at least 16 characters"):
        ServiceSettings(api_token="short")
    with pytest.raises(ValueError, match=r"api_token_file '.*missing'"):
        ServiceSettings(api_token_file=tmp_path / "missing").api_token_value()


def test_a_service_without_a_token_refuses_to_start_naming_the_settings():
    env = {"PATH": "/usr/bin:/bin", "SHELLRL_PORT": "1"}
    done = run_owned(
        [sys.executable, "-m", "services.verifier"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout_s=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no API token: set SHELLRL_API_TOKEN or SHELLRL_API_TOKEN_FILE" in done.stderr
    assert "SHELLRL_AUTH_DISABLED=true for local development" in done.stderr


def test_the_launcher_hands_a_fresh_token_over_in_a_file_only_its_user_reads(tmp_path):
    first, second = StackConfig(state_dir=tmp_path), StackConfig(state_dir=tmp_path)
    assert first.api_token != second.api_token and len(first.api_token) >= 43
    tmp_path.mkdir(exist_ok=True)
    Stack(first)._write_token_file()
    mode = first.api_token_file.stat().st_mode
    assert (
        stat.S_IMODE(mode) == 0o600 and first.api_token_file.read_text().strip() == first.api_token
    )
    assert api_headers(tmp_path, environ={}) == {"Authorization": f"Bearer {first.api_token}"}
    other = new_token()
    assert api_headers(tmp_path, environ={"SHELLRL_API_TOKEN": other}) == {
        "Authorization": f"Bearer {other}"
    }
    assert api_headers(tmp_path / "none", environ={}) == {}


async def test_the_sandbox_client_sends_the_token_and_reports_a_refusal_as_a_4xx():
    app = create_app("sandbox", {}, api_token=TOKEN)

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str) -> dict:
        return {"session_id": session_id}

    transport = httpx.ASGITransport(app=app)
    async with SandboxClient("http://sandbox", transport=transport, api_token=TOKEN) as sandbox:
        assert await sandbox.session_info("s1") == {"session_id": "s1"}
    async with SandboxClient("http://sandbox", transport=transport) as anonymous:
        with pytest.raises(SandboxBadRequest) as refused:
            await anonymous.session_info("s1")
    assert refused.value.status == 401 and refused.value.field == "Authorization"
