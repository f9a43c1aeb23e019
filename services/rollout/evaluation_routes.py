"""HTTP API of the rollout gateway's evaluations (DESIGN.md section 2), over the parts of
parts.py (evaluations.py runs them):

  POST /v1/evaluations         eval split or task ids, fixed budget, greedy or fixed sampling -> 202
  GET  /v1/evaluations/{id}    success rate, mean reward, failure classes, version, per task
  GET  /v1/evaluations         the latest evaluations (summaries)

Errors are 422 `{"error": {"code", "message", "field"}}` naming the field (`task_ids[2]`, `split`,
`episodes_per_task`), 404 for an unknown evaluation. Every route needs the stack's bearer token.
"""

from __future__ import annotations

from fastapi import APIRouter, Query

from services.rollout.episode_spec import Sampling
from services.rollout.evaluations import EvaluationPlan
from services.rollout.parts import PartsDep
from services.rollout.responses import EvaluationList, EvaluationView
from services.rollout.schemas import EvaluationIn
from services.rollout.task_store import TaskStore
from shellrl.service.app import ApiError
from shellrl.service.openapi import error_responses

router = APIRouter()


@router.post(
    "/v1/evaluations",
    status_code=202,
    tags=["evaluations"],
    summary="Start an evaluation",
    response_model=EvaluationView,
    response_model_exclude_unset=True,
    responses=error_responses(422),
)
async def start_evaluation(body: EvaluationIn, parts: PartsDep) -> dict:
    settings = parts.settings
    task_ids = await _evaluation_task_ids(body, parts.store)
    budget = len(task_ids) * body.episodes_per_task
    if budget > settings.eval_max_episodes:
        raise ApiError(
            422,
            "budget_too_large",
            f"episodes_per_task: {budget} episodes exceed the limit of "
            f"{settings.eval_max_episodes} (SHELLRL_EVAL_MAX_EPISODES)",
            "episodes_per_task",
        )
    plan = EvaluationPlan(
        task_ids=task_ids,
        episodes_per_task=body.episodes_per_task,
        sampling=_evaluation_sampling(body, settings.max_new_tokens),
        max_turns=body.max_turns,
        split=body.split,
    )
    return await parts.evaluations.start(plan)


async def _evaluation_task_ids(body: EvaluationIn, store: TaskStore) -> list[str]:
    """The body's task ids (each must exist) or its split's, cut to `max_tasks`; ApiError 422."""
    if body.task_ids is not None:
        for i, task_id in enumerate(body.task_ids):
            if await store.get_task(task_id) is None:
                raise ApiError(
                    422, "unknown_task", f"task_ids[{i}]: no task {task_id!r}", f"task_ids[{i}]"
                )
        task_ids = list(body.task_ids)
    else:
        task_ids = await store.ids_of_split(body.split)
        if not task_ids:
            raise ApiError(422, "empty_split", f"split: no tasks in split {body.split!r}", "split")
    return task_ids[: body.max_tasks] if body.max_tasks else task_ids


def _evaluation_sampling(body: EvaluationIn, default_max_new_tokens: int) -> Sampling:
    """The body's sampling (greedy: temperature 0, no top-p/top-k cut), its max_new_tokens set."""
    sampling = body.sampling or Sampling()
    max_new_tokens = sampling.max_new_tokens or default_max_new_tokens
    if body.greedy:
        return Sampling(max_new_tokens=max_new_tokens)
    return sampling.model_copy(update={"max_new_tokens": max_new_tokens})


@router.get(
    "/v1/evaluations/{evaluation_id}",
    tags=["evaluations"],
    summary="Results of one evaluation",
    response_model=EvaluationView,
    response_model_exclude_unset=True,
    responses=error_responses(404),
)
async def get_evaluation(evaluation_id: str, parts: PartsDep) -> dict:
    view = await parts.evaluations.describe(evaluation_id)
    if view is None:
        raise ApiError(404, "not_found", f"no evaluation {evaluation_id!r}", "evaluation_id")
    return view


@router.get(
    "/v1/evaluations",
    tags=["evaluations"],
    summary="Latest evaluations (summaries)",
    response_model=EvaluationList,
    response_model_exclude_unset=True,
    responses=error_responses(422),
)
async def list_evaluations(parts: PartsDep, limit: int = Query(20, ge=1, le=200)) -> dict:
    return {"evaluations": await parts.evaluations.recent(limit)}
