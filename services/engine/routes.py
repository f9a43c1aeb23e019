"""HTTP routes of the engine, over the parts of parts.py: the SGLang subset of DESIGN.md
section 6, in SGLang's formats.

Formats (docs/sglang.md): `/generate` answers SGLang's response objects; its bad input gives 400
`{"error": {"message", "code", "field"}}` (SGLang's `{"error": {"message"}}` plus shellrl's code
and field). The weight-update routes are weight_routes.py's.
`/flush_cache` answers plain text. `/abort_request` answers 200 with an empty body. Besides these,
the shellrl probes `/healthz`, `/readyz`, `/metrics`, `/v1/config` come from `shellrl.service.app`.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from services.engine import metrics
from services.engine.bodies import (
    AbortBody,
    ContinueBody,
    PauseBody,
    parse_body,
    read_json,
    route_doc,
)
from services.engine.parts import PartsDep
from services.engine.protocol import generate_request_schema, parse_generate
from services.engine.request_state import DuplicateRequestId
from services.engine.response import render_response
from shellrl.service.app import ApiError
from shellrl.service.openapi import error_responses, json_body

_EMPTY_200_503 = {
    200: {"description": "Healthy (empty body)"},
    503: {"description": "Starting, failing or shutting down (empty body)"},
}
DISCONNECT_POLL_S = 1.0


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


router = APIRouter()


@router.api_route(
    "/generate",
    methods=["POST", "PUT"],
    openapi_extra=json_body(generate_request_schema()),
    responses={
        200: {
            "description": "SGLang's response object (a list of them for a batch)",
            "content": {"application/json": {"schema": {"type": ["object", "array"]}}},
        },
        **error_responses(400, 503),
    },
)
async def generate(request: Request, parts: PartsDep):
    if parts.runtime.draining:
        raise ApiError(
            503,
            "shutting_down",
            "the engine is shutting down; send the request to another engine",
        )
    specs, is_batch = parse_generate(
        await read_json(request),
        parts.runtime.limits,
        parts.runtime.tokenizer,
        lambda: uuid.uuid4().hex,
    )
    try:
        states = parts.scheduler.submit_many(specs, asyncio.get_running_loop())  # all or none
    except DuplicateRequestId as exc:
        raise ApiError(400, "duplicate_rid", str(exc), "rid") from exc
    finished = await _wait_or_abort_on_disconnect(request, parts.scheduler, states)
    if finished is None:
        return Response(status_code=499)  # nobody reads it
    _raise_first_error(finished)
    bodies = [render_response(state, parts.runtime.tokenizer) for state in finished]
    return JSONResponse(bodies if is_batch else bodies[0])


def _raise_first_error(finished: list) -> None:
    """ApiError with the status of the first request that finished with a 4xx/5xx."""
    for state in finished:
        status = state.finish_reason.get("status_code")
        if status is not None and 400 <= status < 600:
            raise ApiError(
                status,
                state.finish_reason.get("err_type") or "engine_error",
                state.finish_reason.get("message", "request failed"),
            )


@router.post("/abort_request", response_class=Response, **route_doc(AbortBody))
async def abort_request(request: Request, parts: PartsDep):
    body = await parse_body(request, AbortBody)
    if body.rid or body.abort_all:
        await parts.runtime.run(lambda: parts.scheduler.abort(body.rid, body.abort_all))
    return Response(status_code=200)


@router.post("/pause_generation", **route_doc(PauseBody))
async def pause_generation(request: Request, parts: PartsDep):
    body = await parse_body(request, PauseBody)
    await parts.runtime.run(lambda: parts.scheduler.pause(body.mode))
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation", **route_doc(ContinueBody))
async def continue_generation(request: Request, parts: PartsDep):
    await parse_body(request, ContinueBody)
    await parts.runtime.run(parts.scheduler.resume)
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.api_route(
    "/flush_cache",
    methods=["GET", "POST"],
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        400: {
            "description": "Not flushed: requests are running or waiting",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
    },
)
async def flush_cache(parts: PartsDep):
    if await parts.runtime.run(parts.scheduler.flush_cache):
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
    return PlainTextResponse(
        "Cache not flushed: requests are running or waiting.\n", status_code=400
    )


def model_info(parts: PartsDep) -> dict:
    return parts.runtime.model_info()


def server_info(parts: PartsDep) -> dict:
    return parts.runtime.server_info()


for _path in ("/model_info", "/get_model_info"):
    router.add_api_route(_path, model_info, methods=["GET"])
for _path in ("/server_info", "/get_server_info"):
    router.add_api_route(_path, server_info, methods=["GET"])


@router.get("/get_weight_version")
async def get_weight_version(parts: PartsDep):
    """Compatibility extra: removed from SGLang 0.5.23 (use /model_info), kept by slime's patch."""
    return {"weight_version": parts.runtime.weight_version}


@router.get("/v1/loads")
async def loads(parts: PartsDep):
    device = parts.settings.device
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": "shellrl-engine-0.1.0",
        "accelerator": device.split(":")[0],
        "num_accelerators": 0 if device == "cpu" else 1,
        "loads": [parts.runtime.loads()],
    }


@router.get("/ready", response_class=Response, responses=_EMPTY_200_503)
async def sglang_ready(parts: PartsDep):
    return Response(
        status_code=200 if parts.scheduler.alive and not parts.runtime.draining else 503
    )


@router.get("/health", response_class=Response, responses=_EMPTY_200_503)
@router.get("/health_generate", response_class=Response, responses=_EMPTY_200_503)
async def health_generate(parts: PartsDep):
    if (
        parts.runtime.draining
    ):  # as SGLang during its graceful exit (http_server.py:health_generate)
        return Response(status_code=503)
    return Response(status_code=200 if await parts.runtime.health_generate() else 503)


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def memory_occupation():
    """No-ops: CPU memory is not released (SGLang needs --enable-memory-saver for these)."""
    return JSONResponse(None)
