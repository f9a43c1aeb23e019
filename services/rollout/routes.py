"""HTTP API of the rollout gateway (DESIGN.md section 2), over the parts of parts.py.

  POST /v1/tasks               one task or a list (JSON form of ../shared/tasks/*.jsonl) -> ids
  GET  /v1/tasks/{task_id}     state, episodes, rewards, policy versions that ran it, failures
  GET  /v1/tasks               filters split/source/tag, cursor pagination
  GET  /v1/trajectories/{id}   one finished trajectory's transcript (transcripts.py);
                               ?skip_special_tokens=true: its texts without the chat template's
                               special tokens (for people: the job's eval samples table)
  GET  /v1/trajectories        ?task_id=&limit=: the newest finished trajectories of one task
  GET  /v1/status              admission, pool, in-flight, streams, infra state, engines
plus /healthz /readyz /metrics /v1/config from shellrl.service.app.create_app; the evaluations'
routes are evaluation_routes.py's, the training runs' run_routes.py's.

Validation errors are 422 `{"error": {"code", "message", "field"}}` naming the field
(`instruction`, `check.type`, `tasks[3].max_turns`; more than MAX_TASKS_PER_REQUEST tasks: `tasks`);
bodies over `MAX_BODY_BYTES` are 413. Every route needs the stack's bearer token (401 without it).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from services.rollout import metrics as m
from services.rollout.admission import AdmissionState
from services.rollout.parts import PartsDep
from services.rollout.responses import (
    GatewayStatus,
    TaskPage,
    TasksSubmitted,
    TaskView,
    TrajectoryList,
    Transcript,
)
from services.rollout.schemas import tasks_body
from services.rollout.settings import RolloutSettings
from services.rollout.task_store import TaskConflict
from services.rollout.transcripts import (
    find_task_trajectories,
    find_trajectory,
    trajectory_summary,
    transcript,
)
from shellrl import streams
from shellrl.contract import Task, TaskValidationError, task_from_json
from shellrl.service.app import ApiError
from shellrl.service.openapi import error_responses, json_body

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_TASKS_PER_REQUEST = 10_000


router = APIRouter()


@router.post(
    "/v1/tasks",
    status_code=201,
    tags=["tasks"],
    summary="Submit one task or a list of tasks",
    response_model=TasksSubmitted,
    response_model_exclude_unset=True,
    openapi_extra=json_body(tasks_body(MAX_TASKS_PER_REQUEST)),
    responses=error_responses(409, 413, 422),
)
async def submit_tasks(request: Request, parts: PartsDep) -> JSONResponse:
    """Validates every task first (all or nothing: a 422 names the first bad field, prefixed
    `tasks[i].` for a list), then stores each: `created`, or `duplicate` when the same content
    is already stored under that id. A task id holding different content is 409."""
    body = await read_json(request)
    items = body if isinstance(body, list) else [body]
    prefix = (lambda i: f"tasks[{i}].") if isinstance(body, list) else (lambda i: "")
    tasks = _parse_tasks(items, prefix)
    results = []
    for i, task in enumerate(tasks):
        try:
            result = await parts.store.submit(task)
        except TaskConflict as exc:
            field = f"{prefix(i)}task_id"
            raise ApiError(409, "conflict", f"{field}: {exc}", field) from None
        m.TASKS_SUBMITTED.labels(result.status).inc()
        results.append({"task_id": result.task_id, "status": result.status, "split": result.split})
    payload: dict = {
        "tasks": results,
        "created": sum(r["status"] == "created" for r in results),
        "duplicates": sum(r["status"] == "duplicate" for r in results),
    }
    if not isinstance(body, list):
        payload["task_id"] = results[0]["task_id"]
    return JSONResponse(payload, status_code=201)


def _parse_tasks(items: list, prefix: Callable[[int], str]) -> list[Task]:
    """Every item as a Task; ApiError 422 naming the first bad field (`prefix(i)` + field)."""
    if not items:
        raise ApiError(422, "invalid_task", "an empty list holds no task", "tasks")
    if len(items) > MAX_TASKS_PER_REQUEST:
        raise ApiError(
            422,
            "too_many_tasks",
            f"tasks: at most {MAX_TASKS_PER_REQUEST} tasks per request",
            "tasks",
        )
    tasks = []
    for i, item in enumerate(items):
        try:
            tasks.append(task_from_json(item))
        except TaskValidationError as exc:
            field = f"{prefix(i)}{exc.field}"
            raise ApiError(422, "invalid_task", f"{field}: {exc.message}", field) from None
    return tasks


@router.get(
    "/v1/tasks/{task_id}",
    tags=["tasks"],
    summary="One task and its statistics",
    response_model=TaskView,
    response_model_exclude_unset=True,
    responses=error_responses(404),
)
async def get_task(task_id: str, parts: PartsDep) -> dict:
    view = await parts.store.describe(task_id)
    if view is None:
        raise ApiError(404, "not_found", f"no task {task_id!r}", "task_id")
    return view


@router.get(
    "/v1/tasks",
    tags=["tasks"],
    summary="List tasks (filters, cursor pagination)",
    response_model=TaskPage,
    response_model_exclude_unset=True,
    responses=error_responses(422),
)
async def list_tasks(
    parts: PartsDep,
    split: Literal["train", "eval_id", "eval_ood", "eval"] | None = None,
    source: str | None = None,
    tag: str | None = None,
    cursor: int = Query(0, ge=0, description="next_cursor of the previous page"),
    limit: int = Query(50, ge=1, le=500),
) -> dict:
    page, next_cursor = await parts.store.list_tasks(
        split=split, source=source, tag=tag, cursor=cursor, limit=limit
    )
    return {"tasks": page, "next_cursor": next_cursor, "total": await parts.store.count(split)}


@router.get(
    "/v1/trajectories/{trajectory_id}",
    tags=["trajectories"],
    summary="One finished trajectory as the policy saw it",
    response_model=Transcript,
    response_model_exclude_unset=True,
    responses=error_responses(404),
)
async def get_trajectory(
    trajectory_id: str,
    parts: PartsDep,
    skip_special_tokens: bool = Query(
        False,
        description="Leave the tokenizer's special tokens (the chat template's markers such as "
        "`<|im_start|>`) out of every `text`; `token_ids` are unchanged.",
    ),
) -> dict:
    found = await find_trajectory(parts.redis, trajectory_id, parts.shards.clients[1:])
    if found is None:
        raise ApiError(
            404, "not_found", f"no finished trajectory {trajectory_id!r}", "trajectory_id"
        )
    traj, stream, entry_id = found
    decode = parts.chat.decode_readable if skip_special_tokens else parts.chat.decode
    return transcript(traj, decode, stream=stream, entry_id=entry_id)


@router.get(
    "/v1/trajectories",
    tags=["trajectories"],
    summary="The newest finished trajectories of one task (summaries)",
    response_model=TrajectoryList,
    response_model_exclude_unset=True,
    responses=error_responses(422),
)
async def list_trajectories(
    parts: PartsDep,
    task_id: str = Query(min_length=1, max_length=256),
    limit: int = Query(10, ge=1, le=100),
) -> dict:
    found = await find_task_trajectories(parts.redis, task_id, limit, parts.shards.clients[1:])
    return {
        "task_id": task_id,
        "trajectories": [trajectory_summary(t, stream=s, entry_id=e) for t, s, e in found],
    }


@router.get(
    "/v1/status",
    tags=["status"],
    summary="Admission, pool, episodes in flight, streams",
    response_model=GatewayStatus,
    response_model_exclude_unset=True,
)
async def status(parts: PartsDep) -> dict:
    settings, worker = parts.settings, parts.worker
    adm = await parts.admission.state()
    return {
        "policy_version": adm.learner_version,
        "admission": _admission_status(adm, settings),
        "episodes_in_flight": worker.running,
        "episode_slots_taken": worker.capacity.used,
        "max_episodes_in_flight": settings.max_episodes_in_flight,
        "trajectories_published": worker.published,
        "uptime_s": round(time.time() - worker.started_at, 1),
        "pool": {"tasks": await parts.pool.size(), "epoch": await parts.pool.epoch()},
        "tasks": {"total": await parts.store.count()},
        "streams": {
            "episodes_backlog_verifier": await worker.producer.backlog(streams.GROUP_VERIFIER),
            "episodes_backlog_bound": settings.episodes_backlog_bound,
        },
        "infra_down": sorted(parts.gate.down),
        "sandbox_health": await parts.health.read_status(),
        "worker_enabled": settings.worker_enabled,
        "engines": parts.directory.status(),
        "sandboxes": parts.sandbox.status(),
    }


def _admission_status(adm: AdmissionState, settings: RolloutSettings) -> dict:
    return {
        "groups_admitted": adm.groups_admitted,
        "bound": adm.bound,
        "groups_in_flight": adm.groups_in_flight,
        "oldest_in_flight_version": adm.oldest_in_flight_version,
        "max_staleness": settings.max_staleness,
        "groups_per_step": settings.groups_per_step,
        "strict": settings.strict_staleness,
        "can_admit": adm.groups_admitted < adm.bound,
    }


async def read_json(request: Request) -> Any:
    """The request's JSON body (413 past MAX_BODY_BYTES, 422 naming no field when not JSON)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, "payload_too_large", f"body over {MAX_BODY_BYTES} bytes", None)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, "payload_too_large", f"body over {MAX_BODY_BYTES} bytes", None)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(422, "invalid_json", f"body is not valid JSON: {exc}", None) from None
    if _LONG_INTEGER.search(raw):  # orjson reads integers past 64 bits as (rounded) floats
        try:
            return json.loads(raw)  # valid JSON (orjson said so), integers exact
        except RecursionError:
            raise ApiError(422, "invalid_json", "body nests too deeply", None) from None
    return body


_LONG_INTEGER = re.compile(rb"\d{19}")
