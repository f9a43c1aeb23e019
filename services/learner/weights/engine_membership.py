"""Which engines the learner pushes to: the seed list (SHELLRL_ENGINE_URLS) plus every engine that
registered itself in `shellrl:engines` (shellrl.clients.engine_registry), read again every
`refresh_s` from `WeightSync.reconcile`, i.e. between steps of the learner's loop.

    new live registration, model fingerprint equal to the learner's ─▶ joins out of rotation
        ─▶ the same reconcile gives it a full update to the current version (it registered
           once it served, so no health probe first)
        ─▶ in rotation: shellrl:engines:sync shows its instance and version (the gateway routes)
    fingerprint differs ─▶ refused: never pushed to; an error log and its sync entry name the
        engine, the model it serves and the model the learner trains
    registration leaving (draining) or gone (no heartbeat within its ttl) ─▶ no more pushes (a
        seed engine stays a member, out of rotation until it answers again)
    restarted: a new registration instance, or an engine in rotation that reports a weight
        version other than the one it confirmed ─▶ out of rotation, full update as above

Guarantees: an engine is in rotation only after it confirmed the current version (so the
gateway never routes a joined or restarted engine before it serves the current weights), and
leaving engines never hold back the publication of a version. Redis errors are logged and the
previous view kept; nothing here raises into the learner's loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from services.learner.weights.engine_rotation import (
    EngineState,
    bounded,
    take_out_of_rotation,
    write_engine_states,
)
from shellrl.clients.engine_registry import EngineRegistration, read_registrations
from shellrl.streams.keys import ENGINE_SYNC_KEY

if TYPE_CHECKING:
    from services.learner.weights.weight_sync import WeightSync

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0


class EngineMembership:
    """Keeps `sync.engines` (and the client's members) in step with the registry; see the module
    docstring. fingerprint, model: the learner's (`engine_registry.model_fingerprint`)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        sync: WeightSync,
        *,
        model: str,
        fingerprint: str,
        summary: str = "",
        refresh_s: float = 1.0,
    ) -> None:
        self.redis, self.sync, self.refresh_s = redis, sync, refresh_s
        self.model, self.fingerprint, self.summary = model, fingerprint, summary
        self.seeds = set(sync.engines)
        self.registered: dict[str, EngineRegistration] = {}
        self.refused: dict[str, str] = {}  # url -> why, while that registration lasts
        self._last_s = float("-inf")
        self._versions: asyncio.Future | None = None  # background weight_version probe
        self._probed_ok_at: dict[str, float | None] = {}

    def status(self) -> dict:
        return {
            "seeds": sorted(self.seeds),
            "registered": sorted(self.registered),
            "refused": dict(self.refused),
        }

    async def refresh(self) -> list[str]:
        """At most every `refresh_s`: apply joins, refusals, leaves and restarts (module doc).
        Returns the engines that joined or registered a new instance now: they serve, and the
        caller (`WeightSync.reconcile`) gives them a full update at once."""
        now = time.monotonic()
        if now - self._last_s < self.refresh_s:
            return []
        self._last_s = now
        if self._check_versions():
            await write_engine_states(self.redis, self.sync.engines)
        try:
            live = await read_registrations(self.redis)
        except Exception as exc:  # Redis away: keep the last view
            log.warning("could not read shellrl:engines", extra={"error": str(exc)})
            return []
        joined = []
        for url, registration in live.items():
            if not registration.leaving and await self._admit(url, registration):
                joined.append(url)
        for url in [u for u in self.registered if u not in live or live[u].leaving]:
            await self._leave(url, "leaving" if url in live else "no heartbeat within its ttl")
        for url in [u for u in self.refused if u not in live]:
            del self.refused[url]
        self._start_version_probe()
        return joined

    # ----- joins, refusals, leaves ------------------------------------------------------------

    async def _admit(self, url: str, registration: EngineRegistration) -> bool:
        """True when `url` joined or registered a new instance now (it needs a full update)."""
        if registration.fingerprint != self.fingerprint:
            await self._refuse(url, registration)
            return False
        self.refused.pop(url, None)
        self.registered[url] = registration
        state = self.sync.engines.get(url)
        if state is None:
            state = EngineState(url, in_rotation=False)
            self.sync.engines[url] = state
            self.sync.client.add_url(url, available=False)
            log.info(
                "engine joined; a full weight update follows before it takes traffic",
                extra={"engine": url, "instance": registration.instance},
            )
        elif state.instance == registration.instance:
            return False
        elif state.instance is None:
            log.info(
                "seed engine registered; a full weight update follows before it takes traffic",
                extra={"engine": url, "instance": registration.instance},
            )
        else:
            log.warning(
                "engine restarted (new instance); out of rotation until it has the current weights",
                extra={"engine": url, "instance": registration.instance},
            )
        take_out_of_rotation(state, f"new instance {registration.instance}: needs a full update")
        state.instance = registration.instance
        self.sync.client.set_available(url, False)
        await write_engine_states(self.redis, self.sync.engines)
        return True

    async def _refuse(self, url: str, registration: EngineRegistration) -> None:
        reason = (
            f"refused engine {url}: it serves model {registration.model!r} "
            f"({registration.summary or 'config unknown'}; fingerprint {registration.fingerprint}),"
            f" but the learner trains {self.model!r} ({self.summary}; fingerprint "
            f"{self.fingerprint})"
        )
        if self.refused.get(url) != reason:
            log.error(reason, extra={"engine": url, "instance": registration.instance})
            entry = {"url": url, "in_rotation": False, "refused": reason}
            try:
                await self.redis.hset(ENGINE_SYNC_KEY, url, json.dumps(entry))
            except Exception as exc:
                log.warning("could not write the refusal", extra={"error": str(exc)})
        self.refused[url] = reason
        await self._leave(url, "refused")

    async def _leave(self, url: str, why: str) -> None:
        """No more pushes to `url`; a seed engine that was not refused stays a member, out of
        rotation until it answers again (reconcile's probe)."""
        self.registered.pop(url, None)
        state = self.sync.engines.get(url)
        if state is None:
            return
        if url in self.seeds and why != "refused":
            take_out_of_rotation(state, f"registration {why}")
            state.instance = None
            self.sync.client.set_available(url, False)
            await write_engine_states(self.redis, self.sync.engines)
            return
        log.info("engine left; no more weight pushes to it", extra={"engine": url, "why": why})
        del self.sync.engines[url]
        self.sync.client.remove_url(url)
        if self.sync.groups is not None:
            self.sync.groups.forget(url)
        self._probed_ok_at.pop(url, None)
        try:
            await self.redis.hdel(ENGINE_SYNC_KEY, url)
        except Exception as exc:
            log.warning("could not forget the engine", extra={"engine": url, "error": str(exc)})

    # ----- restarts seen in the served version ------------------------------------------------

    def _start_version_probe(self) -> None:
        """Read the weight_version of every engine in rotation, in the background."""
        if self._versions is not None:
            return
        targets = [u for u, e in self.sync.engines.items() if e.in_rotation and e.version]
        if not targets:
            return
        self._probed_ok_at = {u: self.sync.engines[u].last_ok_at for u in targets}
        client = self.sync.client

        async def one(url: str) -> tuple[str, str | None]:
            versions = await bounded(client.get_weight_version(urls=[url]), PROBE_TIMEOUT_S)
            return url, None if versions is None else versions.get(url)

        self._versions = asyncio.ensure_future(asyncio.gather(*(one(u) for u in targets)))

    def _check_versions(self) -> bool:
        """An engine that reports another version than it confirmed, with no push confirmed since
        the probe began, was restarted: out of rotation, so reconcile updates it in full.
        Returns whether any engine was taken out."""
        if self._versions is None or not self._versions.done():
            return False
        probe, self._versions = self._versions, None
        if probe.cancelled() or probe.exception() is not None:
            return False
        changed = False
        for url, served in probe.result():
            state = self.sync.engines.get(url)
            if served is None or state is None or not state.in_rotation:
                continue
            if state.last_ok_at != self._probed_ok_at.get(url) or served == state.version:
                continue
            log.warning(
                "engine serves another weight version than it confirmed (restarted); out of "
                "rotation until it has the current weights",
                extra={"engine": url, "served": served, "confirmed": state.version},
            )
            take_out_of_rotation(
                state, f"serves weight_version {served}, confirmed {state.version}"
            )
            self.sync.client.set_available(url, False)
            changed = True
        return changed
