"""Request bodies of the rollout gateway's HTTP API (routes.py). FastAPI validates `EvaluationIn`
before the route runs (422 naming the field); `tasks_body` only documents the body of
POST /v1/tasks, which `shellrl.contract.task_from_json` validates. The success bodies are
responses.py's."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.rollout.episode_spec import Sampling
from shellrl.contract import LIMITS
from shellrl.contract.task_schema import task_schema_components
from shellrl.service.openapi import REF

EVAL_SPLITS = ("eval_id", "eval_ood", "eval", "train")


def tasks_body(max_tasks: int) -> dict:
    """JSON Schema of the body of POST /v1/tasks: one task or a list of 1 to `max_tasks` (the
    task schema of `shellrl.contract.task_schema`, whose parts go to the OpenAPI components)."""
    task = {"$ref": REF.format(model="Task")}
    return {
        "$defs": task_schema_components(REF),
        "oneOf": [task, {"type": "array", "items": task, "minItems": 1, "maxItems": max_tasks}],
    }


class EvaluationIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    split: Literal["eval_id", "eval_ood", "eval", "train"] | None = Field(
        None, description="Evaluate the tasks of this split (in submission order)."
    )
    task_ids: list[str] | None = Field(
        None, min_length=1, max_length=4096, description="Or exactly these tasks."
    )
    max_tasks: int | None = Field(None, ge=1, description="Take only the first N tasks.")
    episodes_per_task: int = Field(1, ge=1, le=64)
    greedy: bool = Field(True, description="temperature 0; otherwise `sampling` (fixed) is used.")
    sampling: Sampling | None = None
    max_turns: int | None = Field(
        None, ge=1, le=LIMITS["max_turns"], description="Override every task's max_turns."
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.split is None) == (self.task_ids is None):
            raise ValueError("give exactly one of 'split' or 'task_ids'")
        return self
