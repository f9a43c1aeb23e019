"""HTTP API of the sandbox executor (DESIGN.md section 2).

    POST   /v1/sessions                      {"setup", "env", "limits"?, "policy"?} → 201 session + setup result
                                             (+ "warm": from the warm pool, sessions/warm_pool.py)
                                             (a `network: true` policy only when allow_network_policies)
                                             (a policy with `egress` rules: the audited proxy, egress/)
    POST   /v1/sessions/{id}/exec            {"command", "timeout_s"?, "fresh_state"?} → 200 exec result
    POST   /v1/sessions/{id}/kill            → every process of the session killed (workspace kept)
    GET    /v1/sessions/{id}/files/{path}    ?max_bytes=N → raw bytes
    GET    /v1/sessions/{id}                 → commands, safety events, timestamps
    GET    /v1/sessions/{id}/diff            → files changed since setup (workspace/diff.py)
    POST   /v1/sessions/{id}/reset           → state right after setup
    DELETE /v1/sessions/{id}                 → everything removed

Every route takes the parts of parts.py (`parts: PartsDep`). A SessionError leaves as its status
with `{"error": {"code", "message", "field"}}` (plus `details`, and `Retry-After` on a 429).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from services.sandbox.limits import LimitsRequest
from services.sandbox.parts import PartsDep
from services.sandbox.sessions.manager import SessionManager
from services.sandbox.sessions.session import Session, SessionError
from services.sandbox.workspace.diff import DEFAULT_MAX_PATHS, workspace_diff
from services.sandbox.workspace.files import FileReadError
from shellrl.service.app import ApiError, error_body
from shellrl.service.openapi import REF, error_responses

DEFAULT_FILE_MAX_BYTES = 10 << 20
T = TypeVar("T")


_NO_NUL = {"pattern": "^[^\\x00]*$"}  # documented only: the session manager answers 400 naming it


class CreateSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    setup: str = Field(
        "",
        description="Bash script run in the empty workspace; non-zero exit → 422 setup_failed.",
        json_schema_extra=_NO_NUL,
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Task environment; '<workspace>' is substituted."
    )
    limits: LimitsRequest | None = None
    policy: str | None = Field(
        None, description="Policy name from the policy file; default: the service default."
    )


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: str = Field(
        ...,
        description="Bash source, run like `bash -c` in the session.",
        json_schema_extra=_NO_NUL,
    )
    timeout_s: float | None = Field(
        None, gt=0, description="Wall-clock limit; default: the session's timeout_s."
    )
    fresh_state: StrictBool = Field(
        False,
        description=(
            "Run without the session's saved shell state: `bash --noprofile --norc`, the environment "
            "as at session creation (the task env and the fixed variables) without BASH_ENV, ENV and "
            "BASH_FUNC_*, PATH fixed to the system directories, cwd = the workspace root; no file the "
            "session's commands can write is read (saved cwd/variables, startup files), and the saved "
            "state is not updated. For verifier checks: earlier commands cannot shape how this one runs "
            "(except through the workspace and /tmp contents, and processes they left running: "
            "see POST /v1/sessions/{id}/kill)."
        ),
    )


def request_schemas(manager: SessionManager, allow_network_policies: bool) -> dict:
    """The request bodies' schemas with what this instance accepts: its policies (those sharing
    the host network only when allowed), its largest timeout_s, shell variable names in env."""
    create = CreateSessionRequest.model_json_schema(ref_template=REF)
    create.pop("$defs", None)
    policies = sorted(
        name for name, p in manager.policies.items() if allow_network_policies or not p.network
    )
    create["properties"]["policy"]["anyOf"] = [{"enum": policies}, {"type": "null"}]
    create["properties"]["env"]["propertyNames"] = {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}
    exec_ = ExecRequest.model_json_schema(ref_template=REF)
    exec_["properties"]["timeout_s"]["anyOf"][0]["maximum"] = manager.max_timeout_s
    return {"CreateSessionRequest": create, "ExecRequest": exec_}


def _api_error(exc: SessionError) -> ApiError | JSONResponse:
    if exc.details is not None or exc.retry_after_s is not None:
        body = error_body(exc.code, exc.message, exc.field)
        if exc.details is not None:
            body["error"]["details"] = exc.details
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return JSONResponse(body, status_code=exc.status, headers=headers)
    return ApiError(exc.status, exc.code, exc.message, exc.field)


router = APIRouter()


async def _call(coro: Awaitable[T]) -> T | JSONResponse:
    """`await coro`; a SessionError raised as ApiError, or returned as a JSONResponse when it
    carries details or a Retry-After."""
    try:
        return await coro
    except SessionError as exc:
        err = _api_error(exc)
        if isinstance(err, JSONResponse):
            return err
        raise err from None


async def _session(manager: SessionManager, session_id: str) -> Session:
    """The session; ApiError (404) when there is none."""
    try:
        return manager.get(session_id)
    except SessionError as exc:
        raise _as_api_error(exc) from None


def _as_api_error(exc: SessionError) -> ApiError:
    return ApiError(exc.status, exc.code, exc.message, exc.field)


@router.post(
    "/v1/sessions",
    status_code=201,
    tags=["sessions"],
    responses=error_responses(400, 403, 422, 429, 503),
)
async def create_session(req: CreateSessionRequest, parts: PartsDep):
    manager = parts.manager
    policy = manager.policies.get(req.policy or manager.default_policy)
    if policy is not None and policy.network and not parts.allow_network_policies:
        raise ApiError(
            403,
            "network_policy_disabled",
            f"policy {policy.name!r} shares the host network; the sandbox's operator has not "
            "enabled such policies (SHELLRL_ALLOW_NETWORK_POLICIES)",
            "policy",
        )
    limits = manager.default_limits.merged(req.limits)
    result = await _call(parts.warm_pool.create(req.setup, req.env, limits, req.policy))
    if isinstance(result, JSONResponse):
        return result
    session, setup, warm = result
    return {
        "session_id": session.session_id,
        "isolation": manager.isolation.layer,
        "workspace": session.workspace_path,
        "policy": session.policy.name,
        "limits": session.limits.as_dict(),
        "setup": setup.as_dict(),
        "warm": warm,
    }


@router.post(
    "/v1/sessions/{session_id}/exec",
    tags=["sessions"],
    responses=error_responses(400, 404, 422, 503),
)
async def exec_command(session_id: str, req: ExecRequest, parts: PartsDep):
    result = await _call(
        parts.manager.exec(session_id, req.command, req.timeout_s, req.fresh_state)
    )
    return result if isinstance(result, JSONResponse) else result.as_dict()  # 429: headers


@router.post(
    "/v1/sessions/{session_id}/kill", tags=["sessions"], responses=error_responses(404, 503)
)
async def kill_processes(session_id: str, parts: PartsDep):
    """Kill every process of the session (background, setsid and double-forked ones included);
    the workspace, /tmp and the saved shell state stay. The verifier calls it before its checks."""
    duration_ms = await _call(parts.manager.kill_processes(session_id))
    return {"session_id": session_id, "killed": True, "duration_ms": round(duration_ms, 3)}


@router.get(
    "/v1/sessions/{session_id}/files/{path:path}",
    tags=["sessions"],
    response_class=Response,
    responses={
        200: {
            "description": "The file's bytes",
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        },
        **error_responses(400, 403, 404, 413, 422),
    },
)
async def read_file(
    session_id: str,
    path: str,
    parts: PartsDep,
    max_bytes: int = Query(DEFAULT_FILE_MAX_BYTES, ge=0),
):
    session = await _session(parts.manager, session_id)
    relative = _workspace_relative(session, path)
    try:
        data = await asyncio.to_thread(session.workspace.read_file, relative, max_bytes)
    except FileReadError as exc:
        raise ApiError(exc.status, exc.code, exc.message, "path") from None
    return Response(content=data, media_type="application/octet-stream")


def _workspace_relative(session: Session, path: str) -> str:
    """`path` relative to the workspace; an absolute one must name a file under the workspace as
    commands see it (else ApiError 403 path_outside_workspace)."""
    if not path.startswith("/"):
        return path
    prefix = session.workspace_path.rstrip("/") + "/"
    if not path.startswith(prefix):
        raise ApiError(
            403,
            "path_outside_workspace",
            f"{path!r} is not inside the workspace {prefix}",
            "path",
        )
    return path[len(prefix) :]


@router.get("/v1/sessions/{session_id}", tags=["sessions"], responses=error_responses(404))
async def session_info(session_id: str, parts: PartsDep):
    session = await _session(parts.manager, session_id)
    return session.info(parts.manager.isolation.layer)


@router.get(
    "/v1/sessions/{session_id}/diff", tags=["sessions"], responses=error_responses(404, 409)
)
async def session_diff(
    session_id: str,
    parts: PartsDep,
    max_paths: int = Query(DEFAULT_MAX_PATHS, ge=0, le=100_000),
):
    """Files the session's commands added, removed or modified since setup (module doc of
    services/sandbox/workspace/diff.py)."""
    session = await _session(parts.manager, session_id)
    if not session.workspace.snapshotted:
        raise ApiError(409, "no_snapshot", "the session has no post-setup snapshot yet", None)
    paths = session.workspace.paths
    try:
        diff = await asyncio.to_thread(workspace_diff, paths.base, paths.ws, max_paths)
    except FileNotFoundError:  # deleted while walking
        raise ApiError(404, "session_not_found", f"session {session_id!r} is gone", None)
    return {"session_id": session_id, **diff.as_dict()}


@router.post(
    "/v1/sessions/{session_id}/reset", tags=["sessions"], responses=error_responses(404, 503)
)
async def reset_session(session_id: str, parts: PartsDep):
    duration_ms = await _call(parts.manager.reset(session_id))
    return {"session_id": session_id, "reset": True, "duration_ms": round(duration_ms, 3)}


@router.delete("/v1/sessions/{session_id}", tags=["sessions"], responses=error_responses(404))
async def delete_session(session_id: str, parts: PartsDep):
    await _call(parts.manager.delete(session_id))
    return {"session_id": session_id, "deleted": True}
