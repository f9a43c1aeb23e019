"""HTTP API of the sandbox executor (DESIGN.md section 2).

    POST   /v1/sessions                      {"setup", "env", "limits"?, "policy"?} → 201 session + setup result
                                             (+ "warm": from the warm pool, warm_pool.py)
                                             (a `network: true` policy only when allow_network_policies)
                                             (a policy with `egress` rules: the audited proxy, egress/)
    POST   /v1/sessions/{id}/exec            {"command", "timeout_s"?, "fresh_state"?} → 200 exec result
    POST   /v1/sessions/{id}/kill            → every process of the session killed (workspace kept)
    GET    /v1/sessions/{id}/files/{path}    ?max_bytes=N → raw bytes
    GET    /v1/sessions/{id}                 → commands, safety events, timestamps
    GET    /v1/sessions/{id}/diff            → files changed since setup (workspace_diff.py)
    POST   /v1/sessions/{id}/reset           → state right after setup
    DELETE /v1/sessions/{id}                 → everything removed

`build_app(settings)` wires the service for `run_service` (root check, private mount namespace,
policies, isolation probe, cgroups, the session manager, readiness details, metrics);
`create_sandbox_app` builds the routes around a given `SessionManager`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from fastapi import Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from services.sandbox import metrics, mounts
from services.sandbox.egress.doors import egress_doors
from services.sandbox.health import HealthWeights, HostHealth
from services.sandbox.isolation_probe import detect
from services.sandbox.limits import Limits, LimitsRequest
from services.sandbox.policy import PolicySet
from services.sandbox.registration import with_registration
from services.sandbox.resources import setup_resources
from services.sandbox.session import SessionError
from services.sandbox.sessions import SessionManager
from services.sandbox.settings import SandboxSettings
from services.sandbox.uids import UidPool
from services.sandbox.warm_pool import WarmPool
from services.sandbox.workspace import FileReadError
from services.sandbox.workspace_diff import add_diff_route
from shellrl.service.aio import cancel_and_wait
from shellrl.service.app import ApiError, create_app, error_body
from shellrl.service.openapi import REF, error_responses

log = logging.getLogger("services.sandbox")
DEFAULT_FILE_MAX_BYTES = 10 << 20


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


def _request_schemas(manager: SessionManager, allow_network_policies: bool) -> dict:
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


def build_app(settings: SandboxSettings):
    """The sandbox service for `run_service("sandbox", SandboxSettings, build_app)`: probes the
    isolation layers, removes what a crashed instance left, logs the layer (a WARNING when it is not
    bubblewrap) and returns the FastAPI app. SystemExit when not run as root; ValueError when
    max_sessions does not fit the uid block or default_policy is not in the policy file."""
    if settings.max_sessions > settings.uid_block_size - 1:
        raise ValueError(
            "max_sessions must be < uid_block_size (one uid per session plus a probe uid)"
        )
    if os.geteuid() != 0:
        raise SystemExit(
            "services.sandbox runs as root: it mounts size-capped workspaces, creates "
            "cgroups and runs every session as its own unprivileged uid"
        )
    # Own mount namespace (before any thread starts): session mounts never leak to the host.
    private_mounts = mounts.private_mount_namespace()
    policies = PolicySet.load(settings.policy_file)
    if settings.default_policy not in policies.policies:
        raise ValueError(f"default_policy {settings.default_policy!r} is not in the policy file")
    if policies.policies[settings.default_policy].network and not settings.allow_network_policies:
        raise ValueError(
            f"default_policy {settings.default_policy!r} shares the host network: set "
            "SHELLRL_ALLOW_NETWORK_POLICIES=true to allow it"
        )
    exec_mode = settings.exec_mode
    if exec_mode == "session" and not os.access("/usr/bin/python3", os.X_OK):
        log.warning(
            "no /usr/bin/python3 for the session runner: falling back to exec_mode=per_command"
        )
        exec_mode = "per_command"
    uids = UidPool(settings.uid_base, settings.uid_block_size)
    isolation, probes = detect(settings.isolation, uids.probe_uid)
    resources = setup_resources(settings, uids, isolation, private_mounts)
    cgroups = resources.cgroups
    root = settings.workspace_root / f"block-{uids.block}"
    defaults = Limits(
        timeout_s=settings.default_timeout_s,
        cpu_s=settings.cpu_s,
        memory_bytes=settings.memory_bytes,
        address_space_bytes=settings.address_space_bytes,
        pids=settings.pids,
        file_size_bytes=settings.file_size_bytes,
        workspace_bytes=settings.workspace_bytes,
        max_output_bytes=settings.max_output_bytes,
        nofile=settings.nofile,
        cpus=settings.cpus,
    )
    manager = SessionManager(
        root=root,
        isolation=isolation,
        cgroups=cgroups,
        uids=uids,
        policies=policies.policies,
        default_policy=settings.default_policy,
        default_limits=defaults,
        max_sessions=settings.max_sessions,
        session_ttl_s=settings.session_ttl_s,
        setup_timeout_s=settings.setup_timeout_s,
        max_timeout_s=settings.max_timeout_s,
        max_command_bytes=settings.max_command_bytes,
        max_concurrent_execs=settings.max_concurrent_execs,
        admission=resources.admission,
        exec_mode=exec_mode,
        egress=egress_doors(settings),
    )
    manager.clean_stale()
    details = {
        "isolation": isolation.layer,
        "exec_mode": exec_mode,
        "network_isolated": isolation.network_isolated,
        **resources.details(),
        "seccomp": isolation.seccomp_path is not None,
        "private_mount_namespace": private_mounts,
        "uid_block": [uids.first, uids.probe_uid],
        "probes": probes,
    }
    metrics.ISOLATION.info(
        {
            "layer": isolation.layer,
            "cgroups": str(cgroups.available).lower(),
            "network_isolated": str(isolation.network_isolated).lower(),
        }
    )
    metrics.init_series(isolation.layer)
    level = logging.INFO if isolation.layer == "bubblewrap" else logging.WARNING
    degraded = "" if isolation.layer == "bubblewrap" else " (DEGRADED: see README, Security)"
    log.log(level, f"sandbox isolation layer: {isolation.layer.upper()}{degraded}", extra=details)
    config = {
        **settings.public_dict(),
        "port": settings.listen_port,
        "isolation_active": isolation.layer,
    }
    log.info(
        "sandbox configured",
        extra={"host": settings.host, "port": settings.listen_port, "config": config},
    )
    warm_pool = WarmPool(
        manager,
        per_setup=settings.warm_pool_per_setup,
        max_sessions=settings.warm_pool_max_sessions,
        min_repeats=settings.warm_pool_min_repeats,
        reserve_sessions=settings.warm_pool_reserve_sessions,
    )
    app = create_sandbox_app(
        manager,
        config,
        details,
        settings.ttl_sweep_interval_s,
        api_token=settings.api_token_value(),
        allow_network_policies=settings.allow_network_policies,
        warm_pool=warm_pool,
        health=HostHealth(
            settings.workspace_root,
            HealthWeights(
                settings.health_weight_load,
                settings.health_weight_memory,
                settings.health_weight_disk,
                settings.health_weight_latency,
            ),
            max_load_per_cpu=settings.health_max_load_per_cpu,
            max_latency_s=settings.health_max_exec_latency_s,
        ),
        health_interval_s=settings.health_interval_s,
    )
    return with_registration(app, settings)  # shellrl:sandboxes when register_url


def create_sandbox_app(
    manager: SessionManager,
    config: dict,
    ready_details: dict,
    ttl_sweep_interval_s: float,
    *,
    api_token: str | None = None,
    allow_network_policies: bool = False,
    warm_pool: WarmPool | None = None,
    health: HostHealth | None = None,
    health_interval_s: float = 5.0,
):
    """The HTTP API (module doc) around `manager`: `config` is served at GET /v1/config,
    `ready_details` (plus the live session count) at /readyz; expired sessions are looked for every
    `ttl_sweep_interval_s` seconds and every session is deleted at shutdown. Every route but the
    probes needs `api_token` (None: no auth); a session may name a policy with `network: true`
    only with `allow_network_policies` (else 403 network_policy_disabled naming `policy`). Creates
    go through `warm_pool` (warm_pool.py; None: none kept). `health` (health.py; None: default
    weights over manager.root) is sampled every `health_interval_s` and served in /readyz."""
    health = health or HostHealth(manager.root)
    manager.on_exec_overhead = health.observe_exec
    pool = warm_pool or WarmPool(
        manager, per_setup=0, max_sessions=0, min_repeats=1, reserve_sessions=0
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        expiry = asyncio.create_task(manager.expire_loop(ttl_sweep_interval_s))
        filler = asyncio.create_task(pool.run())
        sampler = asyncio.create_task(health.run(health_interval_s))
        try:
            yield
        finally:
            await cancel_and_wait(expiry, filler, sampler)
            await manager.close()

    async def ready_check() -> dict:
        return {
            "ready": True,
            **ready_details,
            "sessions": len(manager.sessions),
            "headroom": manager.headroom(),
            "warm_pool": pool.status(),
            "health": (await asyncio.to_thread(health.sample)).as_dict(),
        }

    app = create_app(
        "sandbox",
        config,
        ready_check=ready_check,
        lifespan=lifespan,
        api_token=api_token,
        openapi_components=_request_schemas(manager, allow_network_policies),
    )
    layer = manager.isolation.layer
    add_diff_route(app, manager)

    async def call(coro):
        try:
            return await coro
        except SessionError as exc:
            err = _api_error(exc)
            if isinstance(err, JSONResponse):
                return err
            raise err from None

    @app.post(
        "/v1/sessions",
        status_code=201,
        tags=["sessions"],
        responses=error_responses(400, 403, 422, 429, 503),
    )
    async def create_session(req: CreateSessionRequest):
        policy = manager.policies.get(req.policy or manager.default_policy)
        if policy is not None and policy.network and not allow_network_policies:
            raise ApiError(
                403,
                "network_policy_disabled",
                f"policy {policy.name!r} shares the host network; the sandbox's operator has not "
                "enabled such policies (SHELLRL_ALLOW_NETWORK_POLICIES)",
                "policy",
            )
        limits = manager.default_limits.merged(req.limits)
        result = await call(pool.create(req.setup, req.env, limits, req.policy))
        if isinstance(result, JSONResponse):
            return result
        session, setup, warm = result
        return {
            "session_id": session.session_id,
            "isolation": layer,
            "workspace": session.workspace_path,
            "policy": session.policy.name,
            "limits": session.limits.as_dict(),
            "setup": setup.as_dict(),
            "warm": warm,
        }

    @app.post(
        "/v1/sessions/{session_id}/exec",
        tags=["sessions"],
        responses=error_responses(400, 404, 422, 503),
    )
    async def exec_command(session_id: str, req: ExecRequest):
        result = await call(manager.exec(session_id, req.command, req.timeout_s, req.fresh_state))
        return result if isinstance(result, JSONResponse) else result.as_dict()  # 429: headers

    @app.post(
        "/v1/sessions/{session_id}/kill", tags=["sessions"], responses=error_responses(404, 503)
    )
    async def kill_processes(session_id: str):
        """Kill every process of the session (background, setsid and double-forked ones included);
        the workspace, /tmp and the saved shell state stay. The verifier calls it before its checks."""
        duration_ms = await call(manager.kill_processes(session_id))
        return {"session_id": session_id, "killed": True, "duration_ms": round(duration_ms, 3)}

    @app.get(
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
        session_id: str, path: str, max_bytes: int = Query(DEFAULT_FILE_MAX_BYTES, ge=0)
    ):
        session = await call(_get(session_id))
        relative = path
        if path.startswith(
            "/"
        ):  # absolute: must name a file under the workspace as commands see it
            prefix = session.workspace_path.rstrip("/") + "/"
            if not path.startswith(prefix):
                raise ApiError(
                    403,
                    "path_outside_workspace",
                    f"{path!r} is not inside the workspace {prefix}",
                    "path",
                )
            relative = path[len(prefix) :]
        try:
            data = await asyncio.to_thread(session.workspace.read_file, relative, max_bytes)
        except FileReadError as exc:
            raise ApiError(exc.status, exc.code, exc.message, "path") from None
        return Response(content=data, media_type="application/octet-stream")

    async def _get(session_id: str):
        return manager.get(session_id)

    @app.get("/v1/sessions/{session_id}", tags=["sessions"], responses=error_responses(404))
    async def session_info(session_id: str):
        session = await call(_get(session_id))
        return session.info(layer)

    @app.post(
        "/v1/sessions/{session_id}/reset", tags=["sessions"], responses=error_responses(404, 503)
    )
    async def reset_session(session_id: str):
        duration_ms = await call(manager.reset(session_id))
        return {"session_id": session_id, "reset": True, "duration_ms": round(duration_ms, 3)}

    @app.delete("/v1/sessions/{session_id}", tags=["sessions"], responses=error_responses(404))
    async def delete_session(session_id: str):
        await call(manager.delete(session_id))
        return {"session_id": session_id, "deleted": True}

    return app
