"""The verifier's composition root: `build_parts(settings)` is the one place its settings become
constructor arguments, and `Parts` is what the routes (routes.py) and the stream worker's
lifespan (lifespan.py) receive. `build_verifier` is also what task-set validation, benchmarks and
tests build a verifier with.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends

from services.verifier.checks import CheckLimits
from services.verifier.reward_components import ComponentWeights, TerminalRewards
from services.verifier.rewards import Shaping
from services.verifier.safety_escalation import SafetyEscalation
from services.verifier.sandbox_view import ReferenceCache
from services.verifier.settings import VerifierSettings
from services.verifier.verification import Verifier
from services.verifier.worker import VerifierWorker
from shellrl import streams
from shellrl.clients.sandbox import SandboxClient
from shellrl.clients.sandbox_fleet import SandboxFleet
from shellrl.service.parts import parts_dependency
from shellrl.streams.keys import STREAM_EVALUATIONS


@dataclass
class Parts:
    """Every component of one verifier, built by `build_parts`."""

    settings: VerifierSettings
    sandbox: SandboxFleet
    redis: aioredis.Redis | None  # None without the worker and the safety component
    verifier: Verifier
    worker: VerifierWorker | None  # None when settings.worker_enabled is off


PartsDep = Annotated[Parts, Depends(parts_dependency(Parts))]
"""A route's parameter `parts: PartsDep` receives the app's Parts (shellrl/service/parts.py)."""


def build_parts(settings: VerifierSettings, api_token: str | None) -> Parts:
    """Build the verifier's components; `api_token` is sent to the sandbox. Connects nothing yet."""
    sandbox = SandboxFleet(  # one URL, a list, and/or the registered ones
        settings.sandbox_url,
        api_token=api_token,
        registry_url=settings.redis_url if settings.sandbox_registry else None,
    )
    redis = None
    if settings.worker_enabled or settings.reward_safety_weight:
        redis = streams.connect(settings.redis_url)
    verifier = build_verifier(settings, sandbox, redis)
    worker = None
    if settings.worker_enabled and redis is not None:  # redis: always, with the worker
        worker = build_worker(settings, redis, verifier, sandbox)
    return Parts(settings, sandbox, redis, verifier, worker)


def build_worker(
    settings: VerifierSettings, redis: aioredis.Redis, verifier: Verifier, sandbox: SandboxFleet
) -> VerifierWorker:
    """The stream worker: shellrl:episodes -> verify -> shellrl:trajectories (or evaluations),
    on every stream shard of `settings.stream_shard_urls` (shard 0: `redis`)."""
    shards = streams.StreamShards(redis, settings.shard_urls)
    consumer = shards.consumer(
        streams.STREAM_EPISODES,
        streams.GROUP_VERIFIER,
        consumer_name(settings),
        block_ms=settings.block_ms,
        count=settings.read_count,
        claim_min_idle_ms=settings.claim_min_idle_ms,
        max_deliveries=settings.max_deliveries,
    )
    return VerifierWorker(
        consumer,
        shards.producer(streams.STREAM_TRAJECTORIES, maxlen=settings.trajectories_stream_maxlen),
        streams.StreamProducer(redis, STREAM_EVALUATIONS),
        verifier,
        sandbox,
        concurrency=settings.concurrency,
        release_sessions=settings.release_sessions,
        shards=shards,
    )


def build_terminal_rewards(settings: VerifierSettings, redis=None) -> TerminalRewards | None:
    """The terminal reward components (None: all off). The safety component keeps its state in
    `redis` (None: a client of settings.redis_url)."""
    weights = ComponentWeights(  # each component's weight is the setting reward_<name>_weight
        **{f.name: getattr(settings, f"reward_{f.name}_weight") for f in fields(ComponentWeights)}
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
