"""HTTP API of the rollout gateway (DESIGN.md section 2) and the lifespan that runs its workers.

  POST /v1/tasks               one task or a list (JSON form of ../shared/tasks/*.jsonl) -> ids
  GET  /v1/tasks/{task_id}     state, episodes, rewards, policy versions that ran it, failures
  GET  /v1/tasks               filters split/source/tag, cursor pagination
  POST /v1/evaluations         eval split or task ids, fixed budget, greedy or fixed sampling -> 202
  GET  /v1/evaluations/{id}    success rate, mean reward, failure classes, version, per task
  GET  /v1/evaluations         the latest evaluations (summaries)
  GET  /v1/status              admission, pool, in-flight, streams, infra state
plus /healthz /readyz /metrics /v1/config from shellrl.service.app.create_app.

Validation errors are 422 `{"error": {"code", "message", "field"}}` naming the field
(`instruction`, `check.type`, `tasks[3].max_turns`); bodies over `MAX_BODY_BYTES` are 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.rollout import metrics as m
from services.rollout.admission import Admission, PolicyVersionWatcher
from services.rollout.agent_loop import AgentLoop, EpisodeLimits, Sampling
from services.rollout.evaluations import EvaluationPlan, Evaluations
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from services.rollout.settings import RolloutSettings
from services.rollout.stats import TaskStats
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskConflict, TaskStore
from services.rollout.worker import Capacity, InfraGate, RolloutConfig, RolloutWorker
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox import SandboxClient
from shellrl.clients.verifier import VerifierClient
from shellrl.contract import LIMITS, TaskValidationError, task_from_json
from shellrl.service.aio import cancel_and_wait
from shellrl.service.app import ApiError, create_app
from shellrl.streams import export_stream_stats

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_TASKS_PER_REQUEST = 10_000
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
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="Default: the gateway's max_new_tokens."
    )


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


def build_app(settings: RolloutSettings) -> FastAPI:
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        redis = connect_redis(
            settings.redis_url, settings.max_episodes_in_flight + settings.eval_max_in_flight + 32
        )
        store = TaskStore(redis)
        chat = ChatFormat.from_tokenizer(load_chat_tokenizer(settings.model_path))
        engine = EngineClient(settings.engine_url_list)
        sandbox = SandboxClient(settings.sandbox_url)
        limits = EpisodeLimits(
            max_turns=settings.max_turns,
            max_context_tokens=settings.max_context_tokens,
            max_observation_chars=settings.max_observation_chars,
            exec_timeout_s=settings.exec_timeout_s,
            episode_timeout_s=settings.episode_timeout_s,
            max_continuations=settings.max_continuations,
            sandbox_busy_poll_s=settings.sandbox_busy_poll_s,
            sandbox_policy=settings.sandbox_policy,
        )
        agent = AgentLoop(engine, sandbox, chat, limits)
        verifier = VerifierClient(settings.verifier_url, settings.verify_timeout_s)
        evaluations = Evaluations(
            redis, store, agent, verifier, max_in_flight=settings.eval_max_in_flight
        )
        watcher = PolicyVersionWatcher(redis)
        admission = Admission(
            redis,
            watcher,
            replica=settings.consumer_name,
            max_staleness=settings.max_staleness,
            groups_per_step=settings.groups_per_step,
            strict=settings.strict_staleness,
        )
        pool = TaskPool(redis, store, consumer=settings.consumer_name, seed=settings.pool_seed)
        gate = InfraGate(
            {"engine": lambda: _all_healthy(engine), "sandbox": lambda: _sandbox_healthy(sandbox)}
        )
        worker = RolloutWorker(
            redis,
            store,
            pool,
            admission,
            agent,
            Capacity(settings.max_episodes_in_flight),
            gate,
            RolloutConfig(
                group_size=settings.group_size,
                sampling=_train_sampling(settings),
                max_attempts=settings.max_attempts,
                retry_backoff_s=settings.retry_backoff_s,
                episodes_backlog_bound=settings.episodes_backlog_bound,
                episodes_stream_maxlen=settings.episodes_stream_maxlen,
            ),
        )
        state.update(
            redis=redis,
            store=store,
            chat=chat,
            engine=engine,
            sandbox=sandbox,
            agent=agent,
            evaluations=evaluations,
            admission=admission,
            pool=pool,
            worker=worker,
            gate=gate,
            watcher=watcher,
        )
        await evaluations.mark_interrupted()
        stop = asyncio.Event()
        background = [asyncio.create_task(watcher.run(), name="policy-version-watcher")]
        if settings.stats_enabled:
            stats = TaskStats(redis, store, admission, consumer=settings.consumer_name)
            background.append(asyncio.create_task(stats.run(stop), name="task-stats"))
        main = None
        if settings.worker_enabled:
            background.append(asyncio.create_task(pool.feed(stop), name="task-pool-feeder"))
            watched = [
                (streams.STREAM_TASKS, streams.GROUP_ROLLOUT),
                (streams.STREAM_EPISODES, streams.GROUP_VERIFIER),
            ]
            background.append(
                asyncio.create_task(export_stream_stats(redis, watched), name="stream-stats")
            )
            main = asyncio.create_task(worker.run(stop), name="rollout-worker")
        for task in (*background, main):
            if task is not None:
                task.add_done_callback(_log_crash)
        log.info("rollout gateway started", extra={"config": settings.public_dict()})
        try:
            yield
        finally:
            stop.set()
            if main is not None:
                await cancel_and_wait(main)  # it may be waiting on the pool, capacity or admission
                await worker.drain(settings.shutdown_grace_s)
            await evaluations.shutdown()
            await cancel_and_wait(*background)
            await engine.close()
            await sandbox.aclose()
            await verifier.aclose()
            await redis.aclose()

    async def ready_check() -> dict:
        if "redis" not in state:
            return {"ready": False, "reason": "starting"}
        await state["redis"].ping()
        return {
            "ready": True,
            "redis": True,
            "infra_down": sorted(state["gate"].down),
            "worker_enabled": settings.worker_enabled,
        }

    app = create_app("rollout", settings.public_dict(), ready_check, lifespan)

    @app.post(
        "/v1/tasks",
        status_code=201,
        tags=["tasks"],
        summary="Submit one task or a list of tasks",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "oneOf": [
                                TaskJson.model_json_schema(),
                                {"type": "array", "items": TaskJson.model_json_schema()},
                            ]
                        }
                    }
                },
            }
        },
    )
    async def submit_tasks(request: Request) -> JSONResponse:
        """Validates every task first (all or nothing: a 422 names the first bad field, prefixed
        `tasks[i].` for a list), then stores each: `created`, or `duplicate` when the same content
        is already stored under that id. A task id holding different content is 409."""
        body = await _read_json(request)
        items = body if isinstance(body, list) else [body]
        prefix = (lambda i: f"tasks[{i}].") if isinstance(body, list) else (lambda i: "")
        if not items:
            raise ApiError(422, "invalid_task", "an empty list holds no task", "tasks")
        if len(items) > MAX_TASKS_PER_REQUEST:
            raise ApiError(
                413,
                "payload_too_large",
                f"at most {MAX_TASKS_PER_REQUEST} tasks per request",
                "tasks",
            )
        tasks = []
        for i, item in enumerate(items):
            try:
                tasks.append(task_from_json(item))
            except TaskValidationError as exc:
                field = f"{prefix(i)}{exc.field}"
                raise ApiError(422, "invalid_task", f"{field}: {exc.message}", field) from None
        results = []
        for i, task in enumerate(tasks):
            try:
                result = await state["store"].submit(task)
            except TaskConflict as exc:
                field = f"{prefix(i)}task_id"
                raise ApiError(409, "conflict", f"{field}: {exc}", field) from None
            m.TASKS_SUBMITTED.labels(result.status).inc()
            results.append(
                {"task_id": result.task_id, "status": result.status, "split": result.split}
            )
        payload: dict = {
            "tasks": results,
            "created": sum(r["status"] == "created" for r in results),
            "duplicates": sum(r["status"] == "duplicate" for r in results),
        }
        if not isinstance(body, list):
            payload["task_id"] = results[0]["task_id"]
        return JSONResponse(payload, status_code=201)

    @app.get("/v1/tasks/{task_id}", tags=["tasks"], summary="One task and its statistics")
    async def get_task(task_id: str) -> dict:
        view = await state["store"].describe(task_id)
        if view is None:
            raise ApiError(404, "not_found", f"no task {task_id!r}", "task_id")
        return view

    @app.get("/v1/tasks", tags=["tasks"], summary="List tasks (filters, cursor pagination)")
    async def list_tasks(
        split: Literal["train", "eval_id", "eval_ood", "eval"] | None = None,
        source: str | None = None,
        tag: str | None = None,
        cursor: int = Query(0, ge=0, description="next_cursor of the previous page"),
        limit: int = Query(50, ge=1, le=500),
    ) -> dict:
        page, next_cursor = await state["store"].list_tasks(
            split=split, source=source, tag=tag, cursor=cursor, limit=limit
        )
        return {
            "tasks": page,
            "next_cursor": next_cursor,
            "total": await state["store"].count(split),
        }

    @app.post(
        "/v1/evaluations", status_code=202, tags=["evaluations"], summary="Start an evaluation"
    )
    async def start_evaluation(body: EvaluationIn) -> dict:
        store: TaskStore = state["store"]
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
                raise ApiError(
                    422, "empty_split", f"split: no tasks in split {body.split!r}", "split"
                )
        if body.max_tasks:
            task_ids = task_ids[: body.max_tasks]
        budget = len(task_ids) * body.episodes_per_task
        if budget > settings.eval_max_episodes:
            raise ApiError(
                422,
                "budget_too_large",
                f"episodes_per_task: {budget} episodes exceed the limit of "
                f"{settings.eval_max_episodes} (SHELLRL_EVAL_MAX_EPISODES)",
                "episodes_per_task",
            )
        sampling_in = body.sampling or SamplingIn()
        sampling = Sampling(
            temperature=0.0 if body.greedy else sampling_in.temperature,
            top_p=1.0 if body.greedy else sampling_in.top_p,
            top_k=-1 if body.greedy else sampling_in.top_k,
            max_new_tokens=sampling_in.max_new_tokens or settings.max_new_tokens,
        )
        plan = EvaluationPlan(
            task_ids=task_ids,
            episodes_per_task=body.episodes_per_task,
            sampling=sampling,
            max_turns=body.max_turns,
            split=body.split,
        )
        return await state["evaluations"].start(plan)

    @app.get(
        "/v1/evaluations/{evaluation_id}", tags=["evaluations"], summary="Results of one evaluation"
    )
    async def get_evaluation(evaluation_id: str) -> dict:
        view = await state["evaluations"].describe(evaluation_id)
        if view is None:
            raise ApiError(404, "not_found", f"no evaluation {evaluation_id!r}", "evaluation_id")
        return view

    @app.get("/v1/evaluations", tags=["evaluations"], summary="Latest evaluations (summaries)")
    async def list_evaluations(limit: int = Query(20, ge=1, le=200)) -> dict:
        return {"evaluations": await state["evaluations"].recent(limit)}

    @app.get("/v1/status", tags=["status"], summary="Admission, pool, episodes in flight, streams")
    async def status() -> dict:
        adm = await state["admission"].state()
        producer = state["worker"].producer
        worker: RolloutWorker = state["worker"]
        return {
            "policy_version": adm.learner_version,
            "admission": {
                "groups_admitted": adm.groups_admitted,
                "bound": adm.bound,
                "groups_in_flight": adm.groups_in_flight,
                "oldest_in_flight_version": adm.oldest_in_flight_version,
                "max_staleness": settings.max_staleness,
                "groups_per_step": settings.groups_per_step,
                "strict": settings.strict_staleness,
                "can_admit": adm.groups_admitted < adm.bound,
            },
            "episodes_in_flight": worker.running,
            "episode_slots_taken": worker.capacity.used,
            "max_episodes_in_flight": settings.max_episodes_in_flight,
            "trajectories_published": worker.published,
            "uptime_s": round(time.time() - worker.started_at, 1),
            "pool": {"tasks": await state["pool"].size(), "epoch": await state["pool"].epoch()},
            "tasks": {"total": await state["store"].count()},
            "streams": {
                "episodes_backlog_verifier": await producer.backlog(streams.GROUP_VERIFIER),
                "episodes_backlog_bound": settings.episodes_backlog_bound,
            },
            "infra_down": sorted(state["gate"].down),
            "worker_enabled": settings.worker_enabled,
        }

    return app


def connect_redis(url: str, max_connections: int):
    """An asyncio Redis client whose pool WAITS for a free connection (up to 30 s) instead of
    failing: redis-py's default pool raises MaxConnectionsError past 100 concurrent commands, and
    hundreds of episodes publish and count at once. Socket timeout and connection class as in
    shellrl.streams.connect."""
    import redis.asyncio as aioredis

    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=30, **streams.pool_kwargs(url)
    )
    return aioredis.Redis.from_pool(pool)


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, "payload_too_large", f"body over {MAX_BODY_BYTES} bytes", None)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, "payload_too_large", f"body over {MAX_BODY_BYTES} bytes", None)
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise ApiError(422, "invalid_json", f"body is not valid JSON: {exc}", None) from None


def _train_sampling(settings: RolloutSettings) -> Sampling:
    return Sampling(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_new_tokens=settings.max_new_tokens,
    )


async def _all_healthy(engine: EngineClient) -> bool:
    return all((await engine.health()).values())


async def _sandbox_healthy(sandbox: SandboxClient) -> bool:
    return bool((await sandbox.ready()).get("ready", True))


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(f"{task.get_name()} stopped", exc_info=task.exception())
