"""HTTP API of the learner, over the parts of parts.py:

GET  /v1/status       version, step, LR, last step's losses/clip fractions/importance weights/parity,
                      throughput, memory, pending groups, engines' state (in rotation, version, error)
POST /v1/checkpoints  write a checkpoint now (after the step in progress) -> 201 {"step", "path"}
POST /v1/pause        stop taking steps (the step in progress finishes) -> {"paused": true, "step": N}; with
                     ?wait=true it answers once that step and its weight push are done, so N is the
                     version the engines serve until /v1/resume (409 pause_timeout when that takes
                     longer than ?timeout_s; the learner stays paused)
POST /v1/resume       take steps again -> {"paused": false, "step": N, "step_target": T}; with
                     ?until_version=T the learner pauses itself once its policy version reaches T
                     (a training run's target_policy_version: no step past it), without it at
                     SHELLRL_MAX_STEPS (0: never)
POST /v1/kl           while paused: KL to the initial policy of given token sequences (eval
                     episodes) -> {"step": N, "sequences": [{"kl_sum", "tokens"}]} (kl_probe.py;
                     409 not_paused / no_reference / sharded)
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from services.learner.kl_probe import KlRequest, sequences_kl
from services.learner.parts import PartsDep
from shellrl.service.app import ApiError
from shellrl.service.openapi import error_responses

router = APIRouter()


@router.get("/v1/status", tags=["learner"])
async def status(parts: PartsDep) -> dict:
    return parts.worker.status()


@router.post("/v1/checkpoints", tags=["learner"], status_code=201, responses=error_responses(504))
async def checkpoint(parts: PartsDep) -> JSONResponse:
    future = parts.worker.request_checkpoint()
    try:
        result = await asyncio.wait_for(asyncio.shield(future), timeout=600)
    except TimeoutError:
        raise ApiError(
            504, "checkpoint_timeout", "the checkpoint did not finish within 600 s"
        ) from None
    return JSONResponse(result, status_code=201)


@router.post("/v1/pause", tags=["learner"], responses=error_responses(409, 422))
async def pause(
    parts: PartsDep, wait: bool = False, timeout_s: float = Query(900.0, gt=0, le=3600)
) -> dict:
    worker = parts.worker
    worker.running.clear()
    if wait:
        try:
            await asyncio.wait_for(worker.paused_idle.wait(), timeout=timeout_s)
        except TimeoutError:  # paused all the same: the caller's wait ran out, no server fault
            raise ApiError(
                409,
                "pause_timeout",
                f"paused, but the step in progress did not finish within {timeout_s:g} s; "
                "call again to wait longer",
                "timeout_s",
            ) from None
    return {"paused": True, "step": worker.version}


@router.post("/v1/resume", tags=["learner"], responses=error_responses(422))
async def resume(parts: PartsDep, until_version: int | None = Query(None, ge=0)) -> dict:
    worker = parts.worker
    worker.resume_training(until_version)
    return {"paused": False, "step": worker.version, "step_target": worker.step_target}


@router.post("/v1/kl", tags=["learner"], responses=error_responses(409, 422))
async def kl(body: KlRequest, parts: PartsDep) -> dict:
    worker = parts.worker
    trainer = worker.trainer
    if trainer.reference_policy is None:
        raise ApiError(409, "no_reference", "no reference policy (SHELLRL_KL_COEF is 0)")
    if trainer.sharded:
        raise ApiError(409, "sharded", "a sharded learner does not score sequences")
    if worker.running.is_set() or not worker.paused_idle.is_set():
        raise ApiError(409, "not_paused", "pause the learner first (POST /v1/pause?wait=true)")
    try:
        rows = await asyncio.to_thread(
            sequences_kl, trainer, body.sequences, worker.config.pad_token_id
        )
    except ValueError as exc:
        raise ApiError(422, "invalid_sequence", str(exc), "sequences") from None
    return {"step": worker.version, "sequences": [r.__dict__ for r in rows]}
