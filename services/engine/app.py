"""HTTP routes of the engine: the SGLang subset of DESIGN.md section 6, in SGLang's formats.

Formats (docs/sglang.md): `/generate` answers SGLang's response objects; its bad input gives 400
`{"error": {"message", "code", "field"}}` (SGLang's `{"error": {"message"}}` plus shellrl's code
and field). Weight-update routes answer `{"success": bool, "message": str}` with 200 or 400.
`/flush_cache` answers plain text. `/abort_request` answers 200 with an empty body. Besides these,
the shellrl probes `/healthz`, `/readyz`, `/metrics`, `/v1/config` come from `shellrl.service.app`.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from datetime import UTC, datetime

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, ValidationError

from services.engine import metrics
from services.engine.protocol import parse_generate
from services.engine.request_state import DuplicateRequestId
from services.engine.response import render_response
from services.engine.runtime import EngineRuntime
from services.engine.scheduler_commands import PAUSE_MODES
from services.engine.settings import EngineSettings
from services.engine.weights import WeightUpdateError
from shellrl.service.app import ApiError, create_app
from shellrl.service.main import Served


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AbortBody(_Body):
    rid: str = ""
    abort_all: StrictBool = False


class PauseBody(_Body):
    mode: str = "abort"


class ContinueBody(_Body):
    torch_empty_cache: StrictBool = (
        True  # SGLang's default (io_struct.py:ContinueGenerationReqInput); no-op here
    )


class BeginBody(_Body):
    selector: str = "all"


class TensorUpdateBody(_Body):
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: StrictBool = False


class InitGroupBody(_Body):
    """SGLang's InitWeightsUpdateGroupReqInput (io_struct.py); rid is BaseReq's."""

    master_address: str
    master_port: StrictInt
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    rid: str | None = None


class DestroyGroupBody(_Body):
    group_name: str = "weight_update_group"
    rid: str | None = None


class DistributedUpdateBody(_Body):
    """SGLang's UpdateWeightsFromDistributedReqInput (io_struct.py)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[StrictInt]]
    group_name: str = "weight_update_group"
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: StrictBool = False
    rid: str | None = None


class DiskUpdateBody(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: StrictBool = False
    weight_version: str | None = None
    is_async: StrictBool = False
    torch_empty_cache: StrictBool = False
    keep_pause: StrictBool = False
    recapture_cuda_graph: StrictBool = False
    token_step: int = 0
    flush_cache: StrictBool = True
    manifest: dict | None = None


class WeightVersionBody(_Body):
    new_version: str
    abort_all_requests: StrictBool = True


class WeightsByNameBody(_Body):
    name: str
    truncate_size: int = 100


async def _json(request: Request) -> object:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from exc


def _finite_float(text: str) -> float:
    """A JSON number too large for a float (`1e999`) would read as inf."""
    value = float(text)
    if not math.isfinite(value):
        raise ApiError(
            400, "invalid_json", f"request body is not valid JSON: {text} overflows a float"
        )
    return value


def _no_constant(name: str):
    """Python's json accepts NaN/Infinity, which JSON does not (a temperature of Infinity would
    sample uniformly)."""
    raise ApiError(
        400, "invalid_json", f"request body is not valid JSON: {name} is not a JSON number"
    )


async def _parse(request: Request, model: type[BaseModel]):
    """Body as `model`; ApiError(400) naming the first bad field."""
    try:
        return model.model_validate(await _json(request))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or None
        raise ApiError(400, "invalid_request", f"{where}: {error['msg']}", where) from exc


def _update_failure(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=400)


DISCONNECT_POLL_S = 1.0
DISK_LOAD_FORMATS = (None, "auto", "safetensors")


async def _wait_or_abort_on_disconnect(request: Request, scheduler, states: list) -> list | None:
    """The finished states, or None when the client went away first: then its requests are aborted
    (as SGLang's tokenizer manager does when `request.is_disconnected()`), so that no decoding
    continues for nobody. Checked every DISCONNECT_POLL_S seconds."""
    gathered = asyncio.ensure_future(asyncio.gather(*(state.future for state in states)))
    while True:
        done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
        if done:
            return gathered.result()
        if await request.is_disconnected():
            live = {state.spec.rid for state in states if not state.future.done()}
            scheduler.call(lambda: scheduler.abort_exact(live))
            metrics.CLIENT_DISCONNECTS.inc(len(live))
            await gathered
            return None


def build_app(settings: EngineSettings) -> Served:
    """Load the model (`EngineRuntime`, seconds to minutes) and serve it: on SIGTERM the engine
    drains (`EngineRuntime.begin_drain`) within `serve_grace_s`. Raises what loading the model
    raises."""
    runtime = EngineRuntime(settings)
    return Served(
        build_app_for(runtime), on_exit_signal=runtime.on_exit_signal, grace_s=runtime.serve_grace_s
    )


def build_app_for(runtime: EngineRuntime) -> FastAPI:
    """The engine's FastAPI app over `runtime`; the app's lifespan starts and stops the scheduler."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        runtime.start()
        try:
            yield
        finally:
            await asyncio.to_thread(runtime.stop)

    async def ready() -> dict:
        return {
            "ready": runtime.scheduler.alive and not runtime.draining,
            "weight_version": runtime.weight_version,
        }

    app = create_app("engine", runtime.settings.public_dict(), ready_check=ready, lifespan=lifespan)
    scheduler = runtime.scheduler

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        if runtime.draining:
            raise ApiError(
                503,
                "shutting_down",
                "the engine is shutting down; send the request to another engine",
            )
        specs, is_batch = parse_generate(
            await _json(request), runtime.limits, runtime.tokenizer, lambda: uuid.uuid4().hex
        )
        try:
            states = scheduler.submit_many(specs, asyncio.get_running_loop())  # all or none
        except DuplicateRequestId as exc:
            raise ApiError(400, "duplicate_rid", str(exc), "rid") from exc
        finished = await _wait_or_abort_on_disconnect(request, scheduler, states)
        if finished is None:
            return Response(status_code=499)  # nobody reads it
        for state in finished:
            status = state.finish_reason.get("status_code")
            if status is not None and 400 <= status < 600:
                raise ApiError(
                    status,
                    state.finish_reason.get("err_type") or "engine_error",
                    state.finish_reason.get("message", "request failed"),
                )
        bodies = [render_response(state, runtime.tokenizer) for state in finished]
        return JSONResponse(bodies if is_batch else bodies[0])

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _parse(request, AbortBody)
        if body.rid or body.abort_all:
            await runtime.run(lambda: scheduler.abort(body.rid, body.abort_all))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await _parse(request, PauseBody)
        if body.mode not in PAUSE_MODES:
            raise ApiError(400, "invalid_request", f"mode must be one of {PAUSE_MODES}", "mode")
        await runtime.run(lambda: scheduler.pause(body.mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await _parse(request, ContinueBody)
        await runtime.run(scheduler.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await runtime.run(scheduler.flush_cache):
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse(
            "Cache not flushed: requests are running or waiting.\n", status_code=400
        )

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        await _parse(request, BeginBody)
        try:
            runtime.begin_session()
        except WeightUpdateError as exc:
            return _update_failure(str(exc))
        return {"success": True, "message": "Weight update session started."}

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await _json(request)
        try:
            return {"success": True, "message": await runtime.end_session()}
        except WeightUpdateError as exc:
            return _update_failure(str(exc))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await _parse(request, TensorUpdateBody)
        try:
            message = await runtime.update_from_tensor(
                body.serialized_named_tensors,
                body.load_format,
                body.weight_version,
                body.abort_all_requests,
            )
        except WeightUpdateError as exc:
            return _update_failure(str(exc))
        return {"success": True, "message": message}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await _parse(request, InitGroupBody)
        try:
            await runtime.init_group(
                body.master_address,
                body.master_port,
                body.rank_offset,
                body.world_size,
                body.group_name,
                body.backend,
            )
        except WeightUpdateError as exc:
            return _update_failure(str(exc))
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await _parse(request, DestroyGroupBody)
        try:
            await runtime.destroy_group(body.group_name)
        except WeightUpdateError as exc:
            return _update_failure(str(exc))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await _parse(request, DistributedUpdateBody)
        try:
            message = await runtime.update_from_distributed(
                body.names,
                body.dtypes,
                body.shapes,
                body.group_name,
                body.load_format,
                body.weight_version,
                body.abort_all_requests,
            )
        except WeightUpdateError as exc:
            return _update_failure(str(exc))
        return {"success": True, "message": message}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _parse(request, DiskUpdateBody)
        if body.load_format not in DISK_LOAD_FORMATS:
            return _update_failure(
                f"load_format {body.load_format!r} is not supported; this engine reads "
                f"safetensors directories (load_format null, 'auto' or 'safetensors')"
            )
        try:
            message = await runtime.update_from_disk(
                body.model_path, body.weight_version, body.abort_all_requests
            )
        except WeightUpdateError as exc:
            return _update_failure(str(exc))
        return {"success": True, "message": message, "num_paused_requests": 0}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await _parse(request, WeightVersionBody)
        await runtime.set_weight_version(body.new_version, body.abort_all_requests)
        return {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
        }

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        body = await _parse(request, WeightsByNameBody)
        param = runtime.weights.params.get(body.name)
        if param is None:
            raise ApiError(400, "invalid_request", f"unknown parameter name {body.name!r}", "name")
        return param.detach().flatten()[: body.truncate_size].float().tolist()

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, runtime.model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, runtime.server_info, methods=["GET"])

    @app.get("/get_weight_version")
    async def get_weight_version():
        """Compatibility extra: removed from SGLang 0.5.23 (use /model_info), kept by slime's patch."""
        return {"weight_version": runtime.weight_version}

    @app.get("/v1/loads")
    async def loads():
        device = runtime.settings.device
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": "shellrl-engine-0.1.0",
            "accelerator": device.split(":")[0],
            "num_accelerators": 0 if device == "cpu" else 1,
            "loads": [runtime.loads()],
        }

    @app.get("/ready")
    async def sglang_ready():
        return Response(status_code=200 if scheduler.alive and not runtime.draining else 503)

    @app.get("/health")
    @app.get("/health_generate")
    async def health_generate():
        if runtime.draining:  # as SGLang during its graceful exit (http_server.py:health_generate)
            return Response(status_code=503)
        return Response(status_code=200 if await runtime.health_generate() else 503)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def memory_occupation():
        """No-ops: CPU memory is not released (SGLang needs --enable-memory-saver for these)."""
        return JSONResponse(None)

    return app
