"""The rollout gateway's app: the lifespan that builds its parts (task store, agent loop,
evaluations, admission, task pool, rollout worker, training runs) and runs its workers;
`build_app` adds the HTTP API of routes.py and run_routes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import FastAPI

from services.rollout import metrics as m
from services.rollout.admission import Admission
from services.rollout.agent_loop import AgentLoop
from services.rollout.engine_directory import EngineDirectory
from services.rollout.episode_spec import EpisodeLimits, Sampling
from services.rollout.evaluations import Evaluations
from services.rollout.gates import Capacity, HealthGate, InfraGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from services.rollout.replicas import Replicas
from services.rollout.routes import add_routes
from services.rollout.run_routes import add_run_routes
from services.rollout.runs import Runs
from services.rollout.settings import RolloutSettings
from services.rollout.stats import TaskStats
from services.rollout.steering import Steering, SteeringConfig
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from services.rollout.worker import RolloutConfig, RolloutWorker
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox_fleet import SandboxFleet
from shellrl.clients.verifier import VerifierClient
from shellrl.service.aio import cancel_and_wait
from shellrl.service.app import create_app
from shellrl.streams import export_stream_stats

log = logging.getLogger(__name__)


def build_app(settings: RolloutSettings) -> FastAPI:
    state: dict[str, Any] = {}
    api_token = settings.api_token_value()  # required by this app, sent to engine/sandbox/verifier

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        redis = connect_redis(
            settings.redis_url, settings.max_episodes_in_flight + settings.eval_max_in_flight + 32
        )
        store = TaskStore(redis)
        chat = ChatFormat.from_tokenizer(load_chat_tokenizer(settings.model_path))
        engine = EngineClient(
            settings.engine_url_list,
            api_token=api_token,
            route_wait_s=settings.engine_route_wait_s,
            allow_empty=True,  # registered engines join (engine_directory.py)
        )
        sandbox = SandboxFleet(
            settings.sandbox_url,
            api_token=api_token,
            registry_url=settings.redis_url if settings.sandbox_registry else None,
        )
        m.SANDBOX_WAITING.set_function(lambda: sandbox.waiting)
        limits = EpisodeLimits(
            max_turns=settings.max_turns,
            max_context_tokens=settings.max_context_tokens,
            max_observation_chars=settings.max_observation_chars,
            exec_timeout_s=settings.exec_timeout_s,
            episode_timeout_s=settings.episode_timeout_s,
            max_continuations=settings.max_continuations,
            sandbox_busy_poll_s=settings.sandbox_busy_poll_s,
            sandbox_policy=settings.sandbox_policy,
            pin_engine=settings.pin_episodes,
            max_engine_failovers=settings.max_engine_failovers,
        )
        agent = AgentLoop(engine, sandbox, chat, limits)
        verifier = VerifierClient(
            settings.verifier_url, settings.verify_timeout_s, api_token=api_token
        )
        evaluations = Evaluations(
            redis,
            store,
            agent,
            verifier,
            max_in_flight=settings.eval_max_in_flight,
            sampling_seed=settings.sampling_seed,
        )
        watcher = PolicyVersionWatcher(redis)
        directory = EngineDirectory(
            redis,
            engine,
            settings.engine_url_list,
            current_version=lambda: watcher.version,
            max_staleness=settings.max_staleness,
            refresh_s=settings.engine_refresh_s,
        )
        admission = Admission(
            redis,
            watcher,
            replica=settings.consumer_name,
            max_staleness=settings.max_staleness,
            groups_per_step=settings.groups_per_step,
            strict=settings.strict_staleness,
            dynamic_sampling=settings.dynamic_sampling,
            group_size=settings.group_size,
            max_attempts=settings.max_attempts,
        )
        steering = _steering(redis, settings)
        pool = TaskPool(
            redis,
            store,
            consumer=settings.consumer_name,
            seed=settings.pool_seed,
            claim_min_idle_ms=settings.claim_min_idle_ms,
            steering=steering,
        )
        gate = InfraGate(
            {
                "engine": lambda: _engine_healthy(engine),
                "sandbox": lambda: _sandbox_healthy(sandbox),
            }
        )
        health = HealthGate(
            sandbox.ready,
            threshold=settings.sandbox_health_threshold,
            delay_s=settings.sandbox_health_delay_s,
            refresh_s=settings.sandbox_health_refresh_s,
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
                sampling_seed=settings.sampling_seed,
            ),
            health=health,
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
            health=health,
            watcher=watcher,
            runs=Runs(redis, store),
        )
        await evaluations.mark_interrupted()
        stop = asyncio.Event()
        state["directory"] = directory
        background = [
            asyncio.create_task(watcher.run(), name="policy-version-watcher"),
            asyncio.create_task(directory.run(stop), name="engine-directory"),
            asyncio.create_task(state["runs"].watch(stop), name="training-runs"),
        ]
        consumers = [pool.consumer]
        if settings.stats_enabled:
            stats = TaskStats(
                redis,
                store,
                admission,
                consumer=settings.consumer_name,
                claim_min_idle_ms=settings.claim_min_idle_ms,
                steering=steering,
            )
            background.append(asyncio.create_task(stats.run(stop), name="task-stats"))
            consumers.append(stats.consumer)
        replicas = Replicas(
            redis,
            pool,
            admission,
            consumers,
            name=settings.consumer_name,
            heartbeat_s=settings.heartbeat_s,
            dead_after_s=settings.replica_dead_after_s,
        )
        background.append(asyncio.create_task(replicas.run(stop), name="replica-heartbeat"))
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

    app = create_app("rollout", settings.public_dict(), ready_check, lifespan, api_token=api_token)
    add_routes(app, state, settings)
    add_run_routes(app, state, settings)
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


def _steering(redis, settings: RolloutSettings) -> Steering | None:
    """Pass-rate steering of the pool (steering.py) when `pass_rate_steering` is on."""
    if not settings.pass_rate_steering:
        return None
    config = SteeringConfig(
        window_episodes=settings.steering_window_episodes,
        low=settings.steering_low,
        high=settings.steering_high,
        keep_fraction=settings.steering_keep_fraction,
        seed=settings.pool_seed,
    )
    return Steering(redis, config)


def _train_sampling(settings: RolloutSettings) -> Sampling:
    return Sampling(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_new_tokens=settings.max_new_tokens,
    )


async def _engine_healthy(engine: EngineClient) -> bool:
    """Some engine the gateway routes to answers its health probe."""
    routable = engine.routing.routable()
    return bool(routable) and any((await engine.health(urls=routable)).values())


async def _sandbox_healthy(sandbox: SandboxFleet) -> bool:
    return bool((await sandbox.ready()).get("ready", True))


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(f"{task.get_name()} stopped", exc_info=task.exception())
