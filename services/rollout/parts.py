"""The rollout gateway's composition root: `build_parts(settings)` is the one place its settings
become constructor arguments, and `Parts` is what the routes (routes.py, run_routes.py) and the
background tasks (lifespan.py) receive.

Built by app.py's lifespan at start-up, once per app lifetime; closed by lifespan.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends

from services.rollout import metrics as m
from services.rollout.admission import Admission
from services.rollout.agent_loop import AgentLoop
from services.rollout.engine_directory import EngineDirectory
from services.rollout.episode_spec import EpisodeLimits, Sampling
from services.rollout.evaluations import Evaluations
from services.rollout.gates import Capacity, InfraGate
from services.rollout.health_gate import HealthGate
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from services.rollout.runs import Runs
from services.rollout.settings import RolloutSettings
from services.rollout.steering import Steering, SteeringConfig
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from services.rollout.worker import RolloutConfig, RolloutWorker
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox_fleet import SandboxFleet
from shellrl.clients.verifier import VerifierClient
from shellrl.service.parts import parts_dependency
from shellrl.streams import StreamShards


@dataclass
class Parts:
    """Every component of one gateway, built by `build_parts`."""

    settings: RolloutSettings
    redis: aioredis.Redis
    shards: StreamShards  # shards[0] is `redis`; the others hold only the two training streams
    store: TaskStore
    chat: ChatFormat
    engine: EngineClient
    sandbox: SandboxFleet
    verifier: VerifierClient
    agent: AgentLoop
    evaluations: Evaluations
    watcher: PolicyVersionWatcher
    directory: EngineDirectory
    admission: Admission
    steering: Steering | None
    pool: TaskPool
    gate: InfraGate
    health: HealthGate
    worker: RolloutWorker
    runs: Runs


PartsDep = Annotated[Parts, Depends(parts_dependency(Parts))]
"""A route's parameter `parts: PartsDep` receives the app's Parts (shellrl/service/parts.py)."""


def build_parts(settings: RolloutSettings, api_token: str | None) -> Parts:
    """Build the gateway's components; `api_token` is sent to the engine, sandbox and verifier.
    Connects nothing yet (Redis and HTTP clients connect on first use)."""
    redis = connect_redis(
        settings.redis_url, settings.max_episodes_in_flight + settings.eval_max_in_flight + 32
    )
    shards = StreamShards(  # the episodes/trajectories streams' Redis instances (shards.py)
        redis,
        settings.shard_urls,
        connect_url=lambda url: connect_redis(url, settings.max_episodes_in_flight + 32),
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
    agent = AgentLoop(engine, sandbox, chat, episode_limits(settings))
    verifier = VerifierClient(settings.verifier_url, settings.verify_timeout_s, api_token=api_token)
    watcher = PolicyVersionWatcher(redis)
    admission = build_admission(redis, watcher, settings, shards)
    steering = build_steering(redis, settings)
    pool = TaskPool(
        redis,
        store,
        consumer=settings.consumer_name,
        seed=settings.pool_seed,
        claim_min_idle_ms=settings.claim_min_idle_ms,
        steering=steering,
    )
    gate = InfraGate(
        {"engine": lambda: _engine_healthy(engine), "sandbox": lambda: _sandbox_healthy(sandbox)}
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
        rollout_config(settings),
        health=health,
        shards=shards,
    )
    return Parts(
        settings=settings,
        redis=redis,
        shards=shards,
        store=store,
        chat=chat,
        engine=engine,
        sandbox=sandbox,
        verifier=verifier,
        agent=agent,
        evaluations=build_evaluations(redis, store, agent, verifier, settings),
        watcher=watcher,
        directory=EngineDirectory(
            redis,
            engine,
            settings.engine_url_list,
            current_version=lambda: watcher.version,
            max_staleness=settings.max_staleness,
            refresh_s=settings.engine_refresh_s,
        ),
        admission=admission,
        steering=steering,
        pool=pool,
        gate=gate,
        health=health,
        worker=worker,
        runs=Runs(redis, store),
    )


def build_admission(
    redis: aioredis.Redis,
    watcher: PolicyVersionWatcher,
    settings: RolloutSettings,
    shards: StreamShards | None = None,
) -> Admission:
    """Admission control by policy version (admission.py) with the training schedule's bound."""
    return Admission(
        redis,
        watcher,
        replica=settings.consumer_name,
        max_staleness=settings.max_staleness,
        groups_per_step=settings.groups_per_step,
        strict=settings.strict_staleness,
        dynamic_sampling=settings.dynamic_sampling,
        group_size=settings.group_size,
        max_attempts=settings.max_attempts,
        shards=shards,
    )


def build_evaluations(
    redis: aioredis.Redis,
    store: TaskStore,
    agent: AgentLoop,
    verifier: VerifierClient,
    settings: RolloutSettings,
) -> Evaluations:
    return Evaluations(
        redis,
        store,
        agent,
        verifier,
        max_in_flight=settings.eval_max_in_flight,
        sampling_seed=settings.sampling_seed,
    )


def connect_redis(url: str, max_connections: int) -> aioredis.Redis:
    """An asyncio Redis client whose pool WAITS for a free connection (up to 30 s) instead of
    failing: redis-py's default pool raises MaxConnectionsError past 100 concurrent commands, and
    hundreds of episodes publish and count at once. Socket timeout and connection class as in
    shellrl.streams.connect."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=30, **streams.pool_kwargs(url)
    )
    return aioredis.Redis.from_pool(pool)


def episode_limits(settings: RolloutSettings) -> EpisodeLimits:
    """The agent loop's per-episode limits."""
    return EpisodeLimits(
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


def rollout_config(settings: RolloutSettings) -> RolloutConfig:
    """The rollout worker's configuration, with the training sampling parameters."""
    return RolloutConfig(
        group_size=settings.group_size,
        sampling=Sampling(
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_new_tokens=settings.max_new_tokens,
        ),
        max_attempts=settings.max_attempts,
        retry_backoff_s=settings.retry_backoff_s,
        episodes_backlog_bound=settings.episodes_backlog_bound,
        episodes_stream_maxlen=settings.episodes_stream_maxlen,
        sampling_seed=settings.sampling_seed,
    )


def build_steering(redis: aioredis.Redis, settings: RolloutSettings) -> Steering | None:
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


async def _engine_healthy(engine: EngineClient) -> bool:
    """Some engine the gateway routes to answers its health probe."""
    routable = engine.routing.routable()
    return bool(routable) and any((await engine.health(urls=routable)).values())


async def _sandbox_healthy(sandbox: SandboxFleet) -> bool:
    return bool((await sandbox.ready()).get("ready", True))
