"""What every service's OpenAPI document says besides its routes: the error body, the bearer
token, and request bodies that a route reads itself.

* `ErrorBody`: `{"error": {"code", "message", "field", "details"?}}`, the body of every 4xx/5xx
  (DESIGN.md section 2). `error_responses(400, 404, ...)` documents the statuses a route answers
  with it (`responses=` of a route).
* `json_body(Model | schema)`: `openapi_extra` for a route that parses its body itself (the rollout
  gateway's tasks, the engine's SGLang bodies), so clients and fuzzers see the real schema.
* `finish_openapi(app, auth, components)`: run once when `/openapi.json` is first asked for; it
  adds `components` (schemas that fields refer to, e.g. the verifier's `Task`), moves the
  nested models of such bodies into `components/schemas`, replaces FastAPI's default 422
  (`HTTPValidationError`, `{"detail": [...]}`, which no route answers) with `ErrorBody`, and with
  `auth` adds the bearer scheme and a 401 to every route but the open ones (auth.OPEN_PATHS).
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from shellrl.service.auth import OPEN_PATHS

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str = Field(description="Stable machine-readable code, e.g. `invalid_request`.")
    message: str
    field: str | None = Field(
        description="The offending field (`check[0].pattern`, `tasks[3].max_turns`), or null."
    )
    details: list | dict | None = Field(
        None, description="Every validation error, or the failed setup's exec result."
    )


class ErrorBody(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


class Health(BaseModel):
    """The body of `/healthz`: the process answers."""

    status: str = Field(description="`ok`.")
    service: str


class Readiness(BaseModel):
    """The body of `/readyz` (200 ready, 503 not): the service's own details besides these."""

    model_config = ConfigDict(extra="allow")
    ready: bool
    service: str
    reason: str | None = Field(None, description="Why not ready (503 only).")


def config_schema(config: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema of `/v1/config`'s body: one property per setting of `config` (the resolved
    settings a service answers), typed by its value (a null value: any type)."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    properties = {
        key: {"type": names[type(value)]} if type(value) in names else {}
        for key, value in config.items()
    }
    return {"type": "object", "title": "Config", "properties": properties}


_DESCRIPTIONS = {
    400: "Bad request (names the field)",
    401: "Missing or wrong `Authorization: Bearer <token>`",
    403: "Forbidden",
    404: "Not found",
    409: "Conflict",
    413: "Request too large",
    422: "Invalid request (names the field)",
    429: "Too many requests: retry later",
    503: "Unavailable: not ready, or shutting down",
    504: "Timed out",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route that answers `statuses` with `ErrorBody`."""
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS.get(s, "Error")} for s in statuses}


def json_body(
    body: type[BaseModel] | dict, *, required: bool = True, description: str | None = None
) -> dict[str, Any]:
    """`openapi_extra` documenting an `application/json` request body: a pydantic model (its
    nested models become components) or a JSON schema."""
    schema = body if isinstance(body, dict) else body.model_json_schema(ref_template=REF)
    request_body: dict[str, Any] = {
        "required": required,
        "content": {"application/json": {"schema": schema}},
    }
    if description:
        request_body["description"] = description
    return {"requestBody": request_body}


def finish_openapi(app: FastAPI, auth: bool, components: dict[str, Any] | None = None) -> None:
    """Install the document builder described in the module docstring on `app`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # a route of two methods: its ids are made unique below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                doc = get_openapi(
                    title=app.title,
                    version=app.version,
                    openapi_version=app.openapi_version,
                    description=app.description,
                    routes=app.routes,
                )
            app.openapi_schema = _finished(doc, auth, components or {})
        return app.openapi_schema

    app.openapi = openapi


def _finished(doc: dict[str, Any], auth: bool, extra: dict[str, Any]) -> dict[str, Any]:
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.update(extra)
    schemas.update(ErrorBody.model_json_schema(ref_template=REF)["$defs"])
    schemas["ErrorBody"] = {
        k: v for k, v in ErrorBody.model_json_schema(ref_template=REF).items() if k != "$defs"
    }
    error_ref = {"$ref": REF.format(model="ErrorBody")}
    seen: set[str] = set()
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            if operation.get("operationId") in seen:  # FastAPI names every method of a route alike
                operation["operationId"] += f"_{method}"
            seen.add(operation.get("operationId"))
            for content in (operation.get("requestBody") or {}).get("content", {}).values():
                schemas.update(content.get("schema", {}).pop("$defs", {}))
            responses = operation.setdefault("responses", {})
            invalid = responses.get("422", {}).get("content", {}).get("application/json", {})
            if invalid.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                invalid["schema"] = error_ref
                responses["422"]["description"] = _DESCRIPTIONS[422]
            if auth and path not in OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
                responses["401"] = {
                    "description": _DESCRIPTIONS[401],
                    "content": {"application/json": {"schema": error_ref}},
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if auth:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "the stack's API token"}
        }
    return doc
