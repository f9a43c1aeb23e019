"""Async client of the sandbox executor (`services/sandbox`, DESIGN.md section 2).

    async with SandboxClient("http://127.0.0.1:8101") as sandbox:
        session = await sandbox.create_session(setup="echo hi > a.txt", env={"HOME": "<workspace>"})
        result = await sandbox.exec(session["session_id"], "cat a.txt", timeout_s=5)
        data = await sandbox.read_file(session["session_id"], "a.txt")
        await sandbox.delete(session["session_id"])

Errors: `SandboxError` (infrastructure: connection failure, 5xx, malformed reply) is the base;
`SandboxBusy` (429, the session cap: wait and retry), `SandboxNotFound` (404),
`SandboxBadRequest` (other 4xx; carries the error body), `SandboxSetupFailed` (the setup script
exited non-zero; carries its `ExecResult`). Retries are the caller's (stream consumer) business,
except that none of these calls is retried here: exec is not idempotent.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Self
from urllib.parse import quote

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_exponential,
)

from shellrl.clients.transport import AiohttpTransport, auth_headers
from shellrl.contract.errors import ContractError
from shellrl.contract.exec import ExecResult


class SandboxError(Exception):
    """The sandbox could not serve the call (connection failure, 5xx, malformed reply)."""

    def __init__(self, message: str, status: int | None = None, body: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, body or {}

    @property
    def code(self) -> str | None:
        return (self.body.get("error") or {}).get("code")

    @property
    def field(self) -> str | None:
        return (self.body.get("error") or {}).get("field")


class SandboxBusy(SandboxError):
    """429: the live-session cap is reached or the host lacks headroom (`body["error"]["details"]
    ["reason"]`); retry after `retry_after_s` (the Retry-After header; None when absent)."""

    retry_after_s: float | None = None


class SandboxNotFound(SandboxError):
    """404: unknown (expired or deleted) session, or missing file."""


class SandboxBadRequest(SandboxError):
    """Another 4xx; `body["error"]` has code, message and the offending field."""


class SandboxSetupFailed(SandboxBadRequest):
    """422 setup_failed: the task's setup script exited non-zero; the session was removed."""

    def __init__(self, message: str, status: int, body: dict, result: ExecResult) -> None:
        super().__init__(message, status, body)
        self.result = result


class SandboxClient:
    """HTTP client of one sandbox service. `timeout_s` bounds each call on top of the command's
    own timeout (an exec waits up to its `timeout_s` + `timeout_s` of this client). `api_token`:
    the stack's bearer token, sent with every call (None: the sandbox runs without auth)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            headers=auth_headers(api_token),
            transport=transport if transport is not None else AiohttpTransport(256),
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self, method: str, path: str, *, timeout_s: float | None = None, **kwargs
    ) -> httpx.Response:
        try:
            response = await self._http.request(
                method, path, timeout=timeout_s or self.timeout_s, **kwargs
            )
        except httpx.HTTPError as exc:
            raise SandboxError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code < 400:
            return response
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"code": "http_error", "message": response.text[:500], "field": None}}
        message = f"{method} {path} -> {response.status_code}: {(body.get('error') or {}).get('message', body)}"
        status = response.status_code
        if status == 429:
            busy = SandboxBusy(message, status, body)
            with contextlib.suppress(ValueError):
                busy.retry_after_s = float(response.headers.get("retry-after", ""))
            raise busy
        if status == 404:
            raise SandboxNotFound(message, status, body)
        if status == 422 and (body.get("error") or {}).get("code") == "setup_failed":
            result = _exec_result(body["error"].get("details") or {})
            raise SandboxSetupFailed(message, status, body, result)
        if 400 <= status < 500:
            raise SandboxBadRequest(message, status, body)
        raise SandboxError(message, status, body)

    async def create_session(
        self,
        setup: str = "",
        env: dict[str, str] | None = None,
        limits: dict | None = None,
        policy: str | None = None,
    ) -> dict[str, Any]:
        """POST /v1/sessions → {"session_id", "isolation", "workspace", "setup": {...exec result...}, ...}.

        `env` values may contain "<workspace>" (the workspace path commands see). Raises
        SandboxSetupFailed, SandboxBusy, SandboxBadRequest, SandboxError.
        """
        body: dict[str, Any] = {"setup": setup, "env": env or {}}
        if limits is not None:
            body["limits"] = limits
        if policy is not None:
            body["policy"] = policy
        setup_timeout_s = self.timeout_s + float((limits or {}).get("setup_timeout_s", 120.0))
        response = await self._request("POST", "/v1/sessions", json=body, timeout_s=setup_timeout_s)
        return response.json()

    async def create_session_when_free(
        self,
        *,
        poll_s: float,
        max_poll_s: float | None = None,
        attempts: int | None = None,
        **session: Any,
    ) -> tuple[dict[str, Any], float]:
        """`create_session(**session)`, retried while the sandbox is at its session cap (429,
        SandboxBusy): after `poll_s` seconds, doubling up to `max_poll_s` (None: a fixed poll_s),
        at most `attempts` tries (None: until a session is free). Returns (the session, seconds
        spent waiting before the successful call). Raises what create_session raises, SandboxBusy
        after the last attempt."""
        first = time.monotonic()
        last = first
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(SandboxBusy),
            wait=wait_exponential(multiplier=poll_s, min=poll_s, max=max_poll_s or poll_s),
            stop=stop_after_attempt(attempts) if attempts else stop_never,
            reraise=True,
        ):
            with attempt:
                last = time.monotonic()
                return await self.create_session(**session), last - first
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    async def exec(
        self,
        session_id: str,
        command: str,
        timeout_s: float | None = None,
        fresh_state: bool = False,
    ) -> ExecResult:
        """POST /v1/sessions/{id}/exec. Raises SandboxNotFound, SandboxBadRequest
        (a NUL byte or a lone UTF-16 surrogate in `command`: 400 naming it), SandboxError. The result's
        `duration_ms` is the run, `queue_ms` the wait before it (earlier commands, a free exec slot).

        fresh_state: run without the session's saved shell state (for verifier checks): bash
        without startup files, the environment as at session creation (task env; no BASH_ENV,
        ENV, BASH_FUNC_*), PATH fixed to the system directories, cwd = the workspace root; the
        saved cwd/variables are neither read nor updated.
        """
        body: dict[str, Any] = {"command": command}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if fresh_state:
            body["fresh_state"] = True
        http_timeout_s = self.timeout_s + (timeout_s if timeout_s is not None else 600.0)
        response = await self._request(
            "POST", f"/v1/sessions/{session_id}/exec", json=body, timeout_s=http_timeout_s
        )
        return _exec_result(response.json())

    async def read_file(self, session_id: str, path: str, max_bytes: int = 10 << 20) -> bytes:
        """GET /v1/sessions/{id}/files/{path}: raw bytes. `path` is relative to the workspace, or absolute
        under the workspace path commands see (e.g. "/workspace/out.txt"). SandboxNotFound (missing file or session),
        SandboxBadRequest (403 outside the workspace, 413 larger than max_bytes, 400 not a file)."""
        response = await self._request(
            "GET",
            f"/v1/sessions/{session_id}/files/{quote(path, safe='')}",
            params={"max_bytes": max_bytes},
        )
        return response.content

    async def session_info(self, session_id: str) -> dict[str, Any]:
        """GET /v1/sessions/{id} → {"commands", "safety_events": [{"rule", "verdict", "command"}], ...}."""
        return (await self._request("GET", f"/v1/sessions/{session_id}")).json()

    async def kill_processes(self, session_id: str) -> dict[str, Any]:
        """POST /v1/sessions/{id}/kill: every process of the session dies (background ones too);
        the workspace and shell state stay. → {"session_id", "killed": true, "duration_ms"}."""
        return (await self._request("POST", f"/v1/sessions/{session_id}/kill")).json()

    async def reset(self, session_id: str) -> dict[str, Any]:
        """POST /v1/sessions/{id}/reset: back to the state right after setup."""
        return (await self._request("POST", f"/v1/sessions/{session_id}/reset")).json()

    async def delete(self, session_id: str) -> None:
        """DELETE /v1/sessions/{id}. Raises SandboxNotFound for an unknown session."""
        await self._request("DELETE", f"/v1/sessions/{session_id}")

    async def diff(self, session_id: str, max_paths: int = 1000) -> dict[str, Any]:
        """GET /v1/sessions/{id}/diff: files changed since setup → {"changed": [{"path",
        "change": added|removed|modified}], "count", "truncated"}. SandboxNotFound (session)."""
        response = await self._request(
            "GET", f"/v1/sessions/{session_id}/diff", params={"max_paths": max_paths}
        )
        return response.json()

    async def ready(self) -> dict[str, Any]:
        """GET /readyz (isolation layer, cgroups, probes)."""
        return (await self._request("GET", "/readyz")).json()


def _exec_result(data: dict) -> ExecResult:
    try:
        return ExecResult.from_json(data)
    except ContractError as exc:
        raise SandboxError(str(exc)) from None
