"""The engine registry in Redis: which engines exist (`shellrl:engines`, written by the engines
themselves) and what the learner made of each (`shellrl:engines:sync`, written by the learner).

    engine (services/engine/registration.py, in the engine or as a sidecar beside SGLang)
      HSET shellrl:engines <url> EngineRegistration   every heartbeat while it serves; leaving=true
                                                      once it drains (SIGTERM); HDEL at exit
    learner (services/learner/weights/engine_membership.py)
      a new live registration whose model fingerprint matches its own gets a full weight push of
      the current version; a mismatch is refused (named in its log and in the sync hash); a
      leaving or dead one gets no more pushes
      HSET shellrl:engines:sync <url> EngineState (services/learner/weights/engine_rotation.py)
    gateway (services/rollout/engine_directory.py)
      routes to a registered engine only once the sync hash shows the learner confirmed a push to
      its current `instance` (so a joined or restarted engine serves the current weights first)

Liveness is judged on Redis's clock (TIME) on both sides, so hosts with skewed clocks agree: a
registration is live while `redis_now - heartbeat_at <= ttl_s`. The fingerprint covers the model
config fields that fix every weight's shape and the vocabulary (`FINGERPRINT_FIELDS`): the
learner's push replaces every weight, so these are what must match; the name is only reported.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from shellrl.clients import registry
from shellrl.clients.registry import Registration
from shellrl.streams.keys import ENGINE_SYNC_KEY, ENGINES_KEY

log = logging.getLogger(__name__)

FINGERPRINT_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclass(frozen=True)
class EngineRegistration(Registration):
    """One engine's entry in `shellrl:engines`. url: where the gateway and learner reach it.
    instance: a new id per process start (a restart on the same URL is a new instance).
    heartbeat_at: Redis TIME of the last write, unix seconds; ttl_s: live that long after it."""

    url: str
    model: str
    fingerprint: str
    instance: str
    summary: str = ""
    heartbeat_at: float = 0.0
    ttl_s: float = 10.0
    leaving: bool = False


@dataclass(frozen=True)
class EngineSync:
    """The learner's word on one engine (a view of its EngineState in `shellrl:engines:sync`).
    version: the weight_version it confirmed; instance: the registration instance it pushed to;
    confirmed_at: unix seconds of that confirmation; refused: why it never pushes to it."""

    url: str
    in_rotation: bool = False
    version: str | None = None
    instance: str | None = None
    confirmed_at: float | None = None
    refused: str | None = None

    @classmethod
    def from_json(cls, raw: str | bytes) -> EngineSync:
        data = json.loads(raw)
        return cls(
            url=str(data["url"]),
            in_rotation=bool(data.get("in_rotation", False)),
            version=None if data.get("version") is None else str(data["version"]),
            instance=data.get("instance"),
            confirmed_at=data.get("last_ok_at"),
            refused=data.get("refused"),
        )


def model_fingerprint(config: Mapping) -> str:
    """16 hex digits of sha256 over the `FINGERPRINT_FIELDS` of a Hugging Face config dict (a
    config.json or `PretrainedConfig.to_dict()`: the defaults transformers fills in for a missing
    num_key_value_heads and head_dim are filled in here too, so both forms agree)."""
    picked = {k: config.get(k) for k in FINGERPRINT_FIELDS}
    heads, hidden = picked["num_attention_heads"], picked["hidden_size"]
    if picked["num_key_value_heads"] is None:
        picked["num_key_value_heads"] = heads
    if picked["head_dim"] is None and heads and hidden:
        picked["head_dim"] = hidden // heads
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def model_summary(config: Mapping) -> str:
    """A short description for messages: 'llama, 2 layers, hidden 64, vocab 49152'."""
    return (
        f"{config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
        f"hidden {config.get('hidden_size')}, vocab {config.get('vocab_size')}"
    )


async def write_registration(redis: aioredis.Redis, registration: EngineRegistration) -> None:
    """HSET the registration with heartbeat_at = Redis's clock now."""
    await registry.write(redis, ENGINES_KEY, registration)


async def delete_registration(redis: aioredis.Redis, url: str, instance: str) -> bool:
    """HDEL `url` if it still holds `instance`'s registration; True when deleted."""
    return await registry.delete(redis, ENGINES_KEY, url, instance)


async def read_registrations(redis: aioredis.Redis) -> dict[str, EngineRegistration]:
    """The live registrations, url -> registration (dead and malformed entries are skipped)."""
    return await registry.read_live(redis, ENGINES_KEY, EngineRegistration, "engine")


async def read_sync(redis: aioredis.Redis) -> dict[str, EngineSync]:
    """The learner's sync hash, url -> EngineSync (malformed entries skipped)."""
    out = {}
    for key, value in (await redis.hgetall(ENGINE_SYNC_KEY)).items():
        url = key.decode() if isinstance(key, bytes) else key
        try:
            out[url] = EngineSync.from_json(value)
        except (ValueError, TypeError, KeyError):
            continue
    return out
