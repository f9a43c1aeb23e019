"""HTTP API of training runs on the rollout gateway (runs.py holds what they do):

  POST /v1/runs                  a train set (inline `tasks` or a `task_file` under the gateway's
                                 task_file_dir) + `steps`, `time_budget_s`, `name` -> 201, the run
  GET  /v1/runs/{run_id}         state, policy version, steps done, progress, episodes since start
  GET  /v1/runs                  the latest runs
  POST /v1/runs/{run_id}/stop    end a training run now: its tasks leave the pool

Errors are 422 `{"error": {"code", "message", "field"}}` naming the field (`tasks[3].check.type`,
`task_file`, `steps`); 409 while another run is training (field `run`) or for a task id holding
other content; 404 for an unknown run; bodies over MAX_BODY_BYTES are 413. Every route needs the
stack's bearer token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.rollout.parts import PartsDep
from services.rollout.responses import RunList, RunView
from services.rollout.routes import MAX_TASKS_PER_REQUEST, read_json
from services.rollout.runs import RunConflict, RunPlan
from shellrl.contract import Task, TaskValidationError, iter_tasks_jsonl, split_name, task_from_json
from shellrl.service.app import ApiError
from shellrl.service.openapi import error_responses

MAX_STEPS = 1_000_000


class RunIn(BaseModel):
    """Body of POST /v1/runs (exactly one of `tasks`, `task_file`)."""

    model_config = ConfigDict(extra="forbid")
    tasks: list[Any] | None = Field(
        None,
        min_length=1,
        max_length=MAX_TASKS_PER_REQUEST,
        description="The train set: tasks in JSON form (split train, the default).",
    )
    task_file: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Or a JSONL task file, relative to the gateway's task_file_dir.",
    )
    steps: int = Field(ge=1, le=MAX_STEPS, description="Learner steps (policy versions) to train.")
    time_budget_s: float | None = Field(
        None, gt=0, description="End the run this many seconds after its start (null: no limit)."
    )
    name: str | None = Field(None, max_length=200, description="A label shown with the run.")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.tasks is None) == (self.task_file is None):
            raise ValueError("give exactly one of 'tasks' or 'task_file'")
        return self


router = APIRouter()


@router.post(
    "/v1/runs",
    status_code=201,
    tags=["runs"],
    summary="Start a training run on a train set",
    response_model=RunView,
    response_model_exclude_unset=True,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RunIn.model_json_schema()}},
        }
    },
    responses=error_responses(404, 409, 413, 422),
)
async def start_run(request: Request, parts: PartsDep) -> JSONResponse:
    """Validates the whole train set first (a 422 names the first bad field), then stores it,
    gives the pool its tasks and records the run (runs.py)."""
    body = parse_run(await read_json(request))
    if body.task_file is not None:
        tasks = await asyncio.to_thread(
            read_task_file, parts.settings.task_file_dir, body.task_file
        )
    else:
        tasks = [_task(item, f"tasks[{i}].") for i, item in enumerate(body.tasks or [])]
    plan = RunPlan(tasks, body.steps, body.time_budget_s, body.name, body.task_file)
    try:
        view = await parts.runs.start(plan)
    except RunConflict as exc:
        raise ApiError(409, "conflict", str(exc), exc.field) from None
    return JSONResponse(view, status_code=201)


@router.get(
    "/v1/runs/{run_id}",
    tags=["runs"],
    summary="Progress of one training run",
    response_model=RunView,
    response_model_exclude_unset=True,
    responses=error_responses(404),
)
async def get_run(run_id: str, parts: PartsDep) -> dict:
    return _found(await parts.runs.describe(run_id), run_id)


@router.get(
    "/v1/runs",
    tags=["runs"],
    summary="Latest training runs",
    response_model=RunList,
    response_model_exclude_unset=True,
    responses=error_responses(422),
)
async def list_runs(parts: PartsDep, limit: int = Query(20, ge=1, le=200)) -> dict:
    return {"runs": await parts.runs.recent(limit)}


@router.post(
    "/v1/runs/{run_id}/stop",
    tags=["runs"],
    summary="End a training run now",
    response_model=RunView,
    response_model_exclude_unset=True,
    responses=error_responses(404),
)
async def stop_run(run_id: str, parts: PartsDep) -> dict:
    return _found(await parts.runs.stop(run_id), run_id)


def parse_run(body: Any) -> RunIn:
    """Validate a POST /v1/runs body. Raises ApiError 422 naming the first bad field."""
    try:
        return RunIn.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or None
        message = f"{field}: {error['msg']}" if field else error["msg"]
        raise ApiError(422, "invalid_run", message, field) from None


def read_task_file(task_file_dir: str | None, name: str) -> list[Task]:
    """The tasks of JSONL file `name` under `task_file_dir` (default split train). Raises
    ApiError 422 (field `task_file`) when no directory is configured, the path leaves it, the
    file cannot be read, or a task is invalid or not a training task."""
    if not task_file_dir:
        raise ApiError(
            422,
            "no_task_file_dir",
            "task_file: this gateway reads no task files (SHELLRL_TASK_FILE_DIR is unset); "
            "send the tasks inline",
            "task_file",
        )
    root = Path(task_file_dir).resolve()
    try:
        path = (root / name).resolve()
    except (OSError, ValueError) as exc:  # a NUL byte, a symlink loop
        message = f"task_file: {name!r} is not a usable path: {exc}"
        raise ApiError(422, "invalid_task_file", message, "task_file") from None
    if not path.is_relative_to(root):
        raise ApiError(
            422, "invalid_task_file", f"task_file: {name!r} is outside {root}", "task_file"
        )
    try:
        with path.open() as f:
            tasks = list(iter_tasks_jsonl(f, default_split="train"))
    except OSError as exc:
        message = f"task_file: cannot read {name!r}: {exc.strerror or exc}"
        raise ApiError(422, "invalid_task_file", message, "task_file") from None
    except TaskValidationError as exc:
        message = f"task_file: {exc.field}: {exc.message}"
        raise ApiError(422, "invalid_task", message, "task_file") from None
    if not tasks:
        raise ApiError(422, "invalid_task_file", f"task_file: {name!r} holds no task", "task_file")
    for n, task in enumerate(tasks, 1):
        if split_name(task.split) != "train":
            message = f"task_file: task {n} has split {split_name(task.split)!r}, not 'train'"
            raise ApiError(422, "not_train_split", message, "task_file")
    return tasks


def _task(item: Any, prefix: str) -> Task:
    try:
        task = task_from_json(item, default_split="train")
    except TaskValidationError as exc:
        field = f"{prefix}{exc.field}"
        raise ApiError(422, "invalid_task", f"{field}: {exc.message}", field) from None
    if split_name(task.split) != "train":
        field = f"{prefix}split"
        message = f"{field}: a train set holds split 'train' tasks, not {split_name(task.split)!r}"
        raise ApiError(422, "not_train_split", message, field)
    return task


def _found(view: dict | None, run_id: str) -> dict:
    if view is None:
        raise ApiError(404, "not_found", f"no run {run_id!r}", "run_id")
    return view
