"""Which engines the rollout gateway sends `generate` to, read again every `refresh_s` from the
engine registry (shellrl.clients.engine_registry) and applied to the engine client's routing:

    members   = seed URLs (SHELLRL_ENGINE_URLS) + live registrations (shellrl:engines) not leaving
    routable  = a member
                and, if registered: the learner's sync entry confirms a push to this very instance
                    (a joined or restarted engine serves the current weights before any traffic)
                and, if it has a sync entry: in rotation, not refused, confirmed version >= floor
                and not marked stale by an answer below the floor (cleared once the learner has
                    confirmed a push to it after the mark)
    floor     = current policy version (shellrl:policy:version) - max_staleness

An engine whose served version is outside the staleness bound is thus skipped until the learner
updates it; an answer from one that slipped through (it restarted between two reads) is discarded
by the client (`StaleEngine`) and its episode moves on to another engine. A leaving (draining) or
dead (no heartbeat) engine stops being a member: no new episode starts there, requests in flight
finish, and the episodes pinned to it move at their next request (engine_pin.py). A seed engine
without a sync entry (no learner writes one, e.g. an evaluation-only gateway) is routable, and
no version judges it, neither its confirmed one nor its answers' (without a learner's word on an
engine there is no authority on what its weights are). Redis errors keep the last view (logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import redis.asyncio as aioredis

from services.rollout import metrics as m
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_registry import (
    EngineRegistration,
    EngineSync,
    read_registrations,
    read_sync,
)
from shellrl.clients.engine_routing import weight_version_number
from shellrl.rl.staleness import oldest_trainable_version

log = logging.getLogger(__name__)


class EngineDirectory:
    """Keeps `engine.routing` in step with the registry (see the module docstring).
    current_version: the learner's published version as the gateway last read it."""

    def __init__(
        self,
        redis: aioredis.Redis,
        engine: EngineClient,
        seeds: Iterable[str],
        *,
        current_version: Callable[[], int],
        max_staleness: int,
        refresh_s: float = 1.0,
    ) -> None:
        self.redis, self.engine, self.refresh_s = redis, engine, refresh_s
        self.seeds = [u.rstrip("/") for u in seeds]
        self.current_version, self.max_staleness = current_version, max_staleness
        self.registered: dict[str, EngineRegistration] = {}
        self.sync: dict[str, EngineSync] = {}
        self.why_not: dict[str, str] = {}  # url -> why it takes no traffic now
        self._stale_baseline: dict[str, float | None] = {}  # url -> confirmed_at before the mark
        engine.routing.version_floor = self.floor_for

    def floor(self) -> int:
        """The oldest weight version an episode may still be sampled with now."""
        return oldest_trainable_version(self.current_version(), self.max_staleness)

    def floor_for(self, url: str) -> int | None:
        """`floor()` for an engine the learner reports on; None (not judged) for others."""
        return self.floor() if url in self.sync else None

    async def run(self, stop: asyncio.Event) -> None:
        """`refresh` every `refresh_s` until `stop`."""
        while not stop.is_set():
            try:
                await self.refresh()
            except Exception as exc:  # Redis away: the last view stays
                log.warning("could not read the engine registry", extra={"error": str(exc)})
            try:
                await asyncio.wait_for(stop.wait(), self.refresh_s)
            except TimeoutError:
                pass

    async def refresh(self) -> None:
        """Read the registry and the learner's sync hash once and apply them."""
        self.registered = {
            u: r for u, r in (await read_registrations(self.redis)).items() if not r.leaving
        }
        previous, self.sync = self.sync, await read_sync(self.redis)
        members = list(dict.fromkeys([*self.seeds, *self.registered]))
        self.why_not = {u: why for u in members if (why := self._why_not(u))}
        routing = self.engine.routing
        self._clear_updated_stale(previous)
        routing.set_members({u: u not in self.why_not for u in members})
        m.ENGINES_ROUTABLE.set(len(routing.routable()))

    def _clear_updated_stale(self, previous: dict[str, EngineSync]) -> None:
        """Clear the stale mark of an engine whose learner confirmation changed since the read
        before the mark (timestamps of one clock, the learner's, are compared: never the
        gateway's with the learner's)."""
        routing = self.engine.routing
        for url in [u for u in self._stale_baseline if u not in routing.stale_since]:
            del self._stale_baseline[url]
        for url in list(routing.stale_since):
            if url not in self._stale_baseline:
                self._stale_baseline[url] = _confirmed_at(previous, url)
            now = _confirmed_at(self.sync, url)
            if now is not None and now != self._stale_baseline[url]:
                routing.clear_stale(url)
                del self._stale_baseline[url]

    def _why_not(self, url: str) -> str | None:
        """Why `url` may take no traffic now (None: it may)."""
        registration, sync = self.registered.get(url), self.sync.get(url)
        if sync is not None and sync.refused:
            return sync.refused
        if registration is not None and (sync is None or sync.instance != registration.instance):
            return "registered; waiting for the learner's full weight update"
        if sync is None:
            return None
        if not sync.in_rotation:
            return "out of the learner's rotation"
        confirmed = None if sync.version is None else weight_version_number(sync.version)
        if confirmed is not None and confirmed < self.floor():
            return f"serves version {confirmed}, below the floor {self.floor()}"
        return None

    def status(self) -> dict:
        """For GET /v1/status: members, which are routable, and why the others are not."""
        routing = self.engine.routing
        return {
            "floor": self.floor(),
            "engines": [
                {
                    "url": u,
                    "registered": u in self.registered,
                    "routable": routing.is_routable(u),
                    "in_flight": routing.in_flight[u],
                    "stale": u in routing.stale_since,
                    "why_not": self.why_not.get(u),
                }
                for u in routing.urls
            ],
        }


def _confirmed_at(sync: dict[str, EngineSync], url: str) -> float | None:
    entry = sync.get(url)
    return None if entry is None else entry.confirmed_at
