"""HTTP conventions shared by every service (not the engine, which speaks SGLang's formats).

* Errors are JSON `{"error": {"code": str, "message": str, "field": str|null}}` (DESIGN.md section 2).
  Raise `ApiError` in a route; request-validation errors become 422 naming the field.
* `create_app(...)` builds a FastAPI app with `/healthz`, `/readyz`, `/metrics` and `/v1/config`.
* `serve(app, host, port)` runs uvicorn and lets it drain in-flight requests on SIGTERM.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from shellrl.service.auth import BearerAuth
from shellrl.service.metrics import metrics_response
from shellrl.service.openapi import Health, Readiness, config_schema, finish_openapi

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], Awaitable[dict[str, Any]]]
"""Returns details for `/readyz`; raise or return {"ready": False, ...} when not ready."""


class ApiError(Exception):
    """An error with an HTTP status, a stable code and the offending field (or None)."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


def error_body(code: str, message: str, field: str | None = None) -> dict:
    return {"error": {"code": code, "message": message, "field": field}}


_LOCATIONS = ("body", "query", "path", "header", "cookie")
_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    429: "too_many_requests",
    503: "unavailable",
}


def _loc_to_field(loc: tuple, error_type: str = "") -> str | None:
    """("body", "check", "path") -> "check.path"; only the leading location is dropped (a body
    field may itself be called `path` or `query`). ("body", 0) "json_invalid" -> None."""
    if error_type == "json_invalid":
        return None
    parts = list(loc[1:] if loc and loc[0] in _LOCATIONS else loc)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as `{"error": {"code", "message", "field"}}`: ApiError, request
    validation (422, naming the first bad field; all of them under `details`), Starlette's own
    HTTP errors (404 unknown route, 405, ...) and unhandled exceptions (500, logged)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, exc.message, exc.field), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = _loc_to_field(tuple(first.get("loc", ())), first.get("type", ""))
        message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
        body = error_body("invalid_request", message, field)
        body["error"]["details"] = [
            {
                "field": _loc_to_field(tuple(e.get("loc", ())), e.get("type", "")),
                "message": e.get("msg"),
            }
            for e in errors[:20]
        ]
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _FASTAPI_PARSE_ERROR:
            # a body FastAPI could not decode (e.g. not UTF-8): an invalid request, as bad JSON is
            message = "body is not valid JSON (not UTF-8 text)"
            return JSONResponse(error_body("invalid_json", message), status_code=422)
        code = _STATUS_CODES.get(exc.status_code, "http_error")
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return JSONResponse(
            error_body(code, str(exc.detail)), status_code=exc.status_code, headers=headers
        )

    app.add_middleware(UnhandledErrors)


_FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (Starlette's 405 names those of the
    first route that matched the path only: `Allow: POST` for GET+POST /v1/tasks)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches({**request.scope, "method": "GET"})[0] != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


class UnhandledErrors:
    """ASGI middleware: an exception no handler took becomes a JSON 500 (logged) answered like
    any other response, so a kept-alive connection stays usable. (A Starlette handler for
    `Exception` runs in ServerErrorMiddleware, which re-raises after answering; uvicorn then closes
    the connection without `Connection: close`, and the client's next request on it fails.)"""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started:  # too late for another response: let the server end the connection
                raise
            log.exception("unhandled error", extra={"path": scope.get("path")})
            body = error_body("internal", f"{type(exc).__name__}: {exc}"[:1000])
            await JSONResponse(body, status_code=500)(scope, receive, send)


def create_app(
    service: str,
    config: dict[str, Any],
    ready_check: ReadyCheck | None = None,
    lifespan=None,
    version: str = "0.1.0",
    api_token: str | None = None,
    openapi_components: dict[str, Any] | None = None,
) -> FastAPI:
    """FastAPI app with the probes every shellrl service has.

    `/healthz`: the process answers. `/readyz`: 200 when `ready_check` says ready, else 503 with
    its details. `/metrics`: Prometheus text. `/v1/config`: the resolved settings. With
    `api_token`, every other route needs `Authorization: Bearer <api_token>` (401 without it:
    shellrl/service/auth.py); None serves every route to anyone (auth disabled).
    `openapi_components`: schemas the routes' models refer to (shellrl/service/openapi.py).
    """
    app = FastAPI(title=f"shellrl {service}", version=version, lifespan=lifespan)
    install_error_handlers(app)
    if api_token is not None:
        app.add_middleware(BearerAuth, token=api_token)  # outermost: refused before anything
    finish_openapi(app, auth=api_token is not None, components=openapi_components)

    @app.get("/healthz", tags=["probes"], response_model=Health)
    async def healthz() -> dict:
        return {"status": "ok", "service": service}

    @app.get(
        "/readyz",
        tags=["probes"],
        responses={
            200: {"model": Readiness, "description": "Ready"},
            503: {"model": Readiness, "description": "Not ready (the details say why)"},
        },
    )
    async def readyz() -> JSONResponse:
        if ready_check is None:
            return JSONResponse({"ready": True, "service": service})
        try:
            details = await ready_check()
        except Exception as exc:  # readiness reports, it never raises
            return JSONResponse(
                {"ready": False, "service": service, "reason": repr(exc)}, status_code=503
            )
        ready = bool(details.get("ready", True))
        return JSONResponse(
            {"service": service, **details, "ready": ready}, status_code=200 if ready else 503
        )

    @app.get(
        "/metrics",
        tags=["probes"],
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "Prometheus text exposition format 0.0.4",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics():
        return metrics_response()

    @app.get(
        "/v1/config",
        tags=["probes"],
        responses={
            200: {
                "description": "The resolved settings (secrets masked)",
                "content": {"application/json": {"schema": config_schema(config)}},
            }
        },
    )
    async def get_config() -> dict:
        return config

    return app


def serve(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    grace_s: float = 10.0,
    on_exit_signal: Callable[[], None] | None = None,
) -> None:
    """Run uvicorn until SIGINT/SIGTERM; in-flight requests get `grace_s` to finish, then uvicorn
    cancels them. `on_exit_signal` runs once, on the event loop's thread, when the first signal
    arrives (the engine uses it to end its in-flight generations as aborts before the grace runs out)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and on_exit_signal is not None:
                on_exit_signal()

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=grace_s,
        log_config=None,
    )
    try:
        _Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it captured once it has shut down
        pass
