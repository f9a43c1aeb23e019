"""The engine's weight-update routes, in SGLang's formats (DESIGN.md section 6), over the parts of
parts.py: a session (`/begin_weight_update` ... `/end_weight_update`), tensor, distributed-group
and disk updates, the version, and `/get_weights_by_name`. Each answers SGLang's
`{"success": bool, "message": str}` with 200, or 400 when the update fails (WeightUpdateError).
"""

from __future__ import annotations

from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.engine.bodies import (
    BeginBody,
    DestroyGroupBody,
    DiskUpdateBody,
    DistributedUpdateBody,
    EndBody,
    InitGroupBody,
    TensorUpdateBody,
    WeightsByNameBody,
    WeightVersionBody,
    parse_body,
    route_doc,
)
from services.engine.parts import PartsDep
from services.engine.weights import WeightUpdateError
from shellrl.service.app import ApiError

DISK_LOAD_FORMATS = (None, "auto", "safetensors")


def _update_failure(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=400)


async def _weight_update(
    call: Awaitable[str | None], message: str | None = None, **extra
) -> dict | JSONResponse:
    """SGLang's answer to a weight-update route: 200 `{"success": true, "message"}` (the call's
    message, or `message` where given) plus `extra`; 400 `{"success": false, "message"}` when the
    call raises WeightUpdateError."""
    try:
        result = await call
    except WeightUpdateError as exc:
        return _update_failure(str(exc))
    return {"success": True, "message": result if message is None else message, **extra}


router = APIRouter()


@router.post("/begin_weight_update", **route_doc(BeginBody, update=True))
async def begin_weight_update(request: Request, parts: PartsDep):
    await parse_body(request, BeginBody)
    try:
        parts.runtime.begin_session()
    except WeightUpdateError as exc:
        return _update_failure(str(exc))
    return {"success": True, "message": "Weight update session started."}


@router.post("/end_weight_update", **route_doc(EndBody, update=True))
async def end_weight_update(request: Request, parts: PartsDep):
    body = await parse_body(request, EndBody)
    return await _weight_update(parts.runtime.end_session(discard=body.discard))


@router.post("/update_weights_from_tensor", **route_doc(TensorUpdateBody, update=True))
async def update_weights_from_tensor(request: Request, parts: PartsDep):
    body = await parse_body(request, TensorUpdateBody)
    return await _weight_update(
        parts.runtime.update_from_tensor(
            body.serialized_named_tensors,
            body.load_format,
            body.weight_version,
            body.abort_all_requests,
        )
    )


@router.post("/init_weights_update_group", **route_doc(InitGroupBody, update=True))
async def init_weights_update_group(request: Request, parts: PartsDep):
    body = await parse_body(request, InitGroupBody)
    return await _weight_update(
        parts.runtime.init_group(
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
        ),
        message="Succeeded to initialize custom process group.",
    )


@router.post("/destroy_weights_update_group", **route_doc(DestroyGroupBody, update=True))
async def destroy_weights_update_group(request: Request, parts: PartsDep):
    body = await parse_body(request, DestroyGroupBody)
    return await _weight_update(
        parts.runtime.destroy_group(body.group_name),
        message="Succeeded to destroy custom process group.",
    )


@router.post("/update_weights_from_distributed", **route_doc(DistributedUpdateBody, update=True))
async def update_weights_from_distributed(request: Request, parts: PartsDep):
    body = await parse_body(request, DistributedUpdateBody)
    return await _weight_update(
        parts.runtime.update_from_distributed(
            body.names,
            body.dtypes,
            body.shapes,
            body.group_name,
            body.load_format,
            body.weight_version,
            body.abort_all_requests,
        )
    )


@router.post("/update_weights_from_disk", **route_doc(DiskUpdateBody, update=True))
async def update_weights_from_disk(request: Request, parts: PartsDep):
    body = await parse_body(request, DiskUpdateBody)
    if body.load_format not in DISK_LOAD_FORMATS:
        return _update_failure(
            f"load_format {body.load_format!r} is not supported; this engine reads "
            f"safetensors directories (load_format null, 'auto' or 'safetensors')"
        )
    return await _weight_update(
        parts.runtime.update_from_disk(
            body.model_path, body.weight_version, body.abort_all_requests
        ),
        num_paused_requests=0,
    )


@router.post("/update_weight_version", **route_doc(WeightVersionBody))
async def update_weight_version(request: Request, parts: PartsDep):
    body = await parse_body(request, WeightVersionBody)
    await parts.runtime.set_weight_version(body.new_version, body.abort_all_requests)
    return {
        "success": True,
        "message": f"Weight version updated to {body.new_version}",
        "new_version": body.new_version,
    }


@router.api_route("/get_weights_by_name", methods=["GET", "POST"], **route_doc(WeightsByNameBody))
async def get_weights_by_name(request: Request, parts: PartsDep):
    body = await parse_body(request, WeightsByNameBody)
    param = parts.runtime.weights.params.get(body.name)
    if param is None:
        raise ApiError(400, "invalid_request", f"unknown parameter name {body.name!r}", "name")
    return param.detach().flatten()[: body.truncate_size].float().tolist()
