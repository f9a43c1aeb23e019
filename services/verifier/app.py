"""HTTP API of the verifier: `POST /v1/verify` (synchronous, the same code path as the stream
worker) and `GET /v1/checks`; the app's lifespan runs the stream worker (worker.py).

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
import contextlib
import logging
import os
import socket

import httpx
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from services.verifier import metrics
from services.verifier.checks import CHECK_PARAMETERS, VERIFIER_VERSION, CheckLimits
from services.verifier.plugin_checks import plugin_check_types
from services.verifier.reward_components import ComponentWeights, TerminalRewards
from services.verifier.rewards import Shaping
from services.verifier.safety_escalation import SafetyEscalation
from services.verifier.sandbox_view import ReferenceCache
from services.verifier.settings import VerifierSettings
from services.verifier.verification import Verifier
from services.verifier.worker import VerifierWorker, release_session
from shellrl import streams
from shellrl.clients.sandbox import SandboxClient
from shellrl.clients.sandbox_fleet import SandboxFleet
from shellrl.contract import TaskValidationError, ToolEvent, task_from_json
from shellrl.contract.task_schema import task_schema_components
from shellrl.service.aio import cancel_and_wait
from shellrl.service.app import ApiError, create_app
from shellrl.service.openapi import REF, error_responses
from shellrl.streams import export_stream_stats
from shellrl.streams.keys import STREAM_EVALUATIONS

log = logging.getLogger(__name__)


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
        description="A task in JSON form (the format of ../shared/tasks/*.jsonl).",
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


def build_terminal_rewards(settings: VerifierSettings, redis=None) -> TerminalRewards | None:
    """The terminal reward components (None: all off). The safety component keeps its state in
    `redis` (None: a client of settings.redis_url)."""
    weights = ComponentWeights(
        settings.reward_safety_weight,
        settings.reward_state_drift_weight,
        settings.reward_time_efficiency_weight,
    )
    if not weights.enabled():
        return None
    escalation = None
    if weights.safety:
        escalation = SafetyEscalation(
            redis if redis is not None else streams.connect(settings.redis_url),
            settings.reward_safety_run,
            base_penalty=settings.reward_safety_penalty,
            escalated_penalty=settings.reward_safety_escalated_penalty,
            escalate_after_steps=settings.reward_safety_escalate_after_steps,
        )
    return TerminalRewards(
        weights,
        escalation,
        drift_max_paths=settings.reward_state_drift_max_paths,
        time_budget_s=settings.reward_time_budget_s,
    )


def build_verifier(
    settings: VerifierSettings, sandbox: SandboxClient | None, redis=None
) -> Verifier:
    limits = CheckLimits(
        settings.check_timeout_s, settings.max_file_bytes, settings.max_answer_chars
    )
    shaping = Shaping(
        settings.shaping_enabled,
        settings.shaping_exit_zero_bonus,
        settings.shaping_exit_zero_cap,
        settings.shaping_timeout_penalty,
        settings.shaping_safety_penalty,
        settings.require_command,
    )
    return Verifier(
        sandbox,
        limits,
        shaping,
        ReferenceCache(sandbox, settings.reference_cache_size),
        build_terminal_rewards(settings, redis),
    )


def consumer_name(settings: VerifierSettings) -> str:
    return settings.consumer_name or f"verifier-{socket.gethostname()}-{os.getpid()}"


def build_app(settings: VerifierSettings) -> FastAPI:
    state: dict = {}
    api_token = settings.api_token_value()  # required by this app and sent to the sandbox

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        sandbox = SandboxFleet(  # one URL, a list, and/or the registered ones
            settings.sandbox_url,
            api_token=api_token,
            registry_url=settings.redis_url if settings.sandbox_registry else None,
        )
        if settings.worker_enabled or settings.reward_safety_weight:
            state["redis"] = streams.connect(settings.redis_url)
        state["sandbox"] = sandbox
        state["verifier"] = build_verifier(settings, sandbox, state.get("redis"))
        state["http"] = httpx.AsyncClient(timeout=2.0)
        stop, worker, worker_task, stats_task = asyncio.Event(), None, None, None
        if settings.worker_enabled:
            redis = state["redis"]
            consumer = streams.StreamConsumer(
                redis,
                streams.STREAM_EPISODES,
                streams.GROUP_VERIFIER,
                consumer_name(settings),
                block_ms=settings.block_ms,
                count=settings.read_count,
                claim_min_idle_ms=settings.claim_min_idle_ms,
                max_deliveries=settings.max_deliveries,
            )
            worker = VerifierWorker(
                consumer,
                streams.StreamProducer(
                    redis,
                    streams.STREAM_TRAJECTORIES,
                    maxlen=settings.trajectories_stream_maxlen,
                ),
                streams.StreamProducer(redis, STREAM_EVALUATIONS),
                state["verifier"],
                sandbox,
                concurrency=settings.concurrency,
                release_sessions=settings.release_sessions,
            )
            worker_task = asyncio.create_task(worker.run(stop))
            stats_task = asyncio.create_task(
                export_stream_stats(redis, [(consumer.stream, consumer.group)])
            )
        log.info(
            "verifier started",
            extra={
                "config": settings.public_dict(),
                "verifier_version": VERIFIER_VERSION,
                "consumer": consumer_name(settings),
            },
        )
        try:
            yield
        finally:
            stop.set()
            if worker is not None:
                await worker.drain(settings.shutdown_grace_s)
                # the loop ends once its read in progress returns (block_ms) and starts nothing more
                await asyncio.wait([worker_task], timeout=settings.block_ms / 1000 + 1)
            await cancel_and_wait(worker_task, stats_task, timeout_s=10.0)
            if "redis" in state:
                await state["redis"].aclose()
            await state["http"].aclose()
            await sandbox.aclose()
            log.info("verifier stopped")

    async def ready_check() -> dict:
        details: dict = {"verifier_version": VERIFIER_VERSION}
        details["sandbox"] = bool((await state["sandbox"].ready())["ready"])
        if settings.worker_enabled:
            details["redis"] = bool(await state["redis"].ping())
        details["ready"] = details["sandbox"] and details.get("redis", True)
        return details

    app = create_app(
        "verifier",
        settings.public_dict(),
        ready_check,
        lifespan,
        api_token=api_token,
        openapi_components=task_schema_components(REF),
    )

    @app.post("/v1/verify", tags=["verifier"], responses=error_responses(422))
    async def verify(request: VerifyRequest) -> dict:
        try:
            task = task_from_json(request.task)
        except TaskValidationError as exc:
            raise ApiError(422, "invalid_task", exc.message, f"task.{exc.field}") from None
        events = [
            ToolEvent(
                command=e.command,
                exit_code=-1 if e.exit_code is None else e.exit_code,
                timed_out=e.timed_out,
                policy_verdict=e.policy_verdict,
                policy_rule=e.policy_rule or "",
                duration_ms=e.duration_ms,
            )
            for e in request.tool_events
        ]
        metrics.IN_FLIGHT.inc()
        try:
            result = await state["verifier"].verify(
                task, request.answer, request.session_id, events, request.trajectory_id
            )
        finally:
            metrics.IN_FLIGHT.dec()
        if request.release_session and request.session_id:
            metrics.SESSION_RELEASES.labels(
                await release_session(state["sandbox"], request.session_id)
            ).inc()
        return result.to_json()

    @app.get("/v1/checks", tags=["verifier"])
    async def list_checks() -> dict:
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
            "default_timeout_s": settings.check_timeout_s,
            "max_file_bytes": settings.max_file_bytes,
        }

    return app
