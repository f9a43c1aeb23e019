"""HTTP API of the verifier, over the parts of parts.py: `POST /v1/verify` (synchronous, the same
code path as the stream worker, worker.py) and `GET /v1/checks`.

GET /v1/checks → 200 {"verifier_version", "checks": [{"type", "source": "shellrl" for a built-in
type, else the plug-in's distribution (with "version", "entry_point", "description"; "error"
instead of "parameters" for a plug-in that cannot be loaded), "parameters": {name: "type =
default"}}], "default_timeout_s", "max_file_bytes"}.

POST /v1/verify body:
  {"task": <task JSON form>, "answer": str|null, "session_id": str|null,
   "tool_events": [{"exit_code", "timed_out", "policy_verdict", "policy_rule", "duration_ms"}] = [],
   "release_session": false, "trajectory_id": ""}
→ 200 {"reward", "training_reward", "reward_components", "checks": [{"type", "passed", "detail", "duration_ms"}],
       "failure": null|"infra_verifier", "failure_detail", "safety_events", "verifier_version", "duration_ms"}
A verification that cannot complete is still a 200 with `failure` set and `reward` null; a bad
request is a 422 naming the field (`task.check[0].pattern`, `tool_events.1.exit_code` …).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from services.verifier import metrics
from services.verifier.checks import CHECK_PARAMETERS, VERIFIER_VERSION
from services.verifier.parts import PartsDep
from services.verifier.plugin_checks import plugin_check_types
from services.verifier.worker import release_session
from shellrl.contract import TaskValidationError, ToolEvent, task_from_json
from shellrl.service.app import ApiError
from shellrl.service.openapi import REF, error_responses


class ToolEventIn(BaseModel):
    """One command of the episode, as the sandbox answered it (for the shaping components)."""

    model_config = ConfigDict(extra="forbid")
    exit_code: StrictInt | None = Field(
        None,
        ge=-(2**31),
        le=2**31 - 1,
        description="null: the command did not exit (timeout, denied).",
    )
    timed_out: StrictBool = False
    policy_verdict: str = Field("allow", pattern="^(allow|flag|deny)$")
    policy_rule: str | None = None
    command: str = ""
    duration_ms: StrictFloat = Field(  # an int is a number of ms, a bool or a string is not
        0.0, ge=0, le=1e10, description="Run time in the sandbox (time_efficiency component)."
    )


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: dict = Field(
        description="A task in JSON form (the body of the rollout gateway's POST /v1/tasks).",
        json_schema_extra={"allOf": [{"$ref": REF.format(model="Task")}]},
    )
    answer: str | None = Field(None, description="The agent's final answer; null = none given.")
    session_id: str | None = Field(
        None, description="Sandbox session of the episode (needed by workspace checks)."
    )
    tool_events: list[ToolEventIn] = Field(default_factory=list, max_length=10_000)
    release_session: StrictBool = Field(False, description="DELETE the session after verifying.")
    trajectory_id: str = Field(
        "",
        max_length=256,
        description="Keys the safety component's record of this episode (a repeat is not "
        "counted twice); '' = not recorded.",
    )


router = APIRouter()


@router.post("/v1/verify", tags=["verifier"], responses=error_responses(422))
async def verify(request: VerifyRequest, parts: PartsDep) -> dict:
    try:
        task = task_from_json(request.task)
    except TaskValidationError as exc:
        raise ApiError(422, "invalid_task", exc.message, f"task.{exc.field}") from None
    events = [_tool_event(e) for e in request.tool_events]
    metrics.IN_FLIGHT.inc()
    try:
        result = await parts.verifier.verify(
            task, request.answer, request.session_id, events, request.trajectory_id
        )
    finally:
        metrics.IN_FLIGHT.dec()
    if request.release_session and request.session_id:
        metrics.SESSION_RELEASES.labels(
            await release_session(parts.sandbox, request.session_id)
        ).inc()
    return result.to_json()


def _tool_event(event: ToolEventIn) -> ToolEvent:
    return ToolEvent(
        command=event.command,
        exit_code=-1 if event.exit_code is None else event.exit_code,
        timed_out=event.timed_out,
        policy_verdict=event.policy_verdict,
        policy_rule=event.policy_rule or "",
        duration_ms=event.duration_ms,
    )


@router.get("/v1/checks", tags=["verifier"])
async def list_checks(parts: PartsDep) -> dict:
    timeout = {"timeout_s": "float = 0 (the verifier's default)"}
    plugins = await asyncio.to_thread(plugin_check_types)  # may import a plug-in
    return {
        "verifier_version": VERIFIER_VERSION,
        "checks": [
            {"type": kind, "source": "shellrl", "parameters": {**params, **timeout}}
            for kind, params in CHECK_PARAMETERS.items()
        ]
        + [
            p if "error" in p else {**p, "parameters": {**p["parameters"], **timeout}}
            for p in plugins
        ],
        "default_timeout_s": parts.settings.check_timeout_s,
        "max_file_bytes": parts.settings.max_file_bytes,
    }
