"""Who may call a service: one shared bearer token per stack (issue 17 item 8).

Every request must carry `Authorization: Bearer <token>`, except the probes and the API's own
description, which hold no data and must stay reachable by Kubernetes, Docker health checks and
Prometheus without a secret:

    /healthz /readyz /metrics             every shellrl service
    /health /health_generate /ready       the engine's SGLang probes
    /openapi.json /docs /redoc            the OpenAPI document and its viewers

Read-only routes need the token too, because they hand out what a caller must not see: task
checks and reference solutions (rollout `GET /v1/tasks`), any file of any session's workspace
(sandbox `GET /v1/sessions/{id}/files/...`), the resolved settings (`GET /v1/config`), model
weights (engine `get_weights_by_name`). One rule for every route also leaves nothing to forget
when a route is added. It is SGLang's rule for `--api-key` (sglang/srt/utils/auth.py: every
endpoint but `/health*`, `/ready*`, `/metrics` needs `Authorization: Bearer <api-key>`), so the
same token and header work against a real SGLang server launched with `--api-key`. The clients
send it (`shellrl.clients.transport.auth_headers`).

The token is compared in constant time (`secrets.compare_digest`). A refused request is answered
401 `{"error": {"code": "unauthorized", "message", "field": "Authorization"}}` with
`WWW-Authenticate: Bearer` (RFC 6750 section 3), before the body is read.
"""

from __future__ import annotations

import re
import secrets

from fastapi.responses import JSONResponse

OPEN_PATHS = frozenset(
    {
        "/healthz",
        "/readyz",
        "/metrics",
        "/health",
        "/health_generate",
        "/ready",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)
TOKEN_PATTERN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
"""RFC 6750's b64token: what may follow `Bearer ` in the header (and survives YAML, shells and
environment variables unquoted)."""
MIN_TOKEN_CHARS = 16


def check_token(token: str) -> str:
    """`token` if it can be a bearer token of this stack, else ValueError saying why: at least
    MIN_TOKEN_CHARS characters of RFC 6750's b64token alphabet."""
    if len(token) < MIN_TOKEN_CHARS or not TOKEN_PATTERN.fullmatch(token):
        raise ValueError(
            f"an API token is at least {MIN_TOKEN_CHARS} characters of A-Z a-z 0-9 . _ ~ + / - "
            "(then optional '='), e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


def new_token() -> str:
    """A fresh random token: 32 bytes of `secrets`, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def unauthorized(message: str) -> JSONResponse:
    """The 401 answer of a request without the right token."""
    return JSONResponse(
        {"error": {"code": "unauthorized", "message": message, "field": "Authorization"}},
        status_code=401,
        headers={"WWW-Authenticate": 'Bearer realm="shellrl"'},
    )


class BearerAuth:
    """ASGI middleware: HTTP requests outside OPEN_PATHS (and CORS preflights, OPTIONS) need
    `Authorization: Bearer <token>`; others get `unauthorized(...)` without reaching the app."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self._expected = check_token(token).encode()

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or scope.get("path") in OPEN_PATHS
        ):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if header is None:
            await unauthorized("missing 'Authorization: Bearer <token>' header")(
                scope, receive, send
            )
            return
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self._expected):
            await unauthorized("wrong API token")(scope, receive, send)
            return
        await self.app(scope, receive, send)
