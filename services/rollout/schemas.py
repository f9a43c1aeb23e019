"""Request bodies of the rollout gateway's HTTP API (routes.py). FastAPI validates `EvaluationIn`
before the route runs (422 naming the field); `TaskJson` only documents the body of
POST /v1/tasks, which `shellrl.contract.task_from_json` validates."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.rollout.settings import check_top_k
from shellrl.contract import LIMITS

EVAL_SPLITS = ("eval_id", "eval_ood", "eval", "train")


class TaskJson(BaseModel):
    """A task in JSON form (documentation of the body; `shellrl.contract.task_from_json` validates)."""

    task_id: str | None = Field(
        None, max_length=LIMITS["task_id_chars"], description="Default: task-<content hash>."
    )
    instruction: str = Field(max_length=LIMITS["instruction_chars"])
    setup: str = Field(
        "", max_length=LIMITS["setup_chars"], description="bash script run in the empty workspace."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description='Extra environment; "<workspace>" is substituted.'
    )
    check: dict | list[dict] = Field(
        description='{"type": "answer_integer_equals", "expected": 4} or a list.'
    )
    split: Literal["train", "eval_id", "eval_ood", "eval"] = "train"
    tags: list[str] = Field(default_factory=list, max_length=LIMITS["tags"])
    max_turns: int = Field(
        0, ge=0, le=LIMITS["max_turns"], description="0 = the gateway's default."
    )
    source: str = ""
    reference_solution: str = ""


class SamplingIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 (disabled) or >= 1; SGLang refuses 0.")
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="Default: the gateway's max_new_tokens."
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        return check_top_k(value)


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
    sampling: SamplingIn | None = None
    max_turns: int | None = Field(
        None, ge=1, le=LIMITS["max_turns"], description="Override every task's max_turns."
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.split is None) == (self.task_ids is None):
            raise ValueError("give exactly one of 'split' or 'task_ids'")
        return self
