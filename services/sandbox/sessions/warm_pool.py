"""Warm pool: sessions created and set up ahead of demand, for task setups that repeat.

Consumes every POST /v1/sessions (through `WarmPool.create`); produces a session either from the
pool (its setup already ran and was snapshotted: a "hit") or from `SessionManager.create` (a
"miss"). A setup is named by its key, sha256 over (setup, env, limits, policy): a warm session
is handed out only for a request with the same key, so it is what a fresh create would have
made, but for when its setup ran (a setup that reads the clock sees an earlier time; its result
is the one reported). Guarantees:

- a warm session is handed out at most once: it leaves the pool when taken and never returns
  (deleting it deletes it, as for any session);
- a setup is kept warm once `min_repeats` creates asked for it (GRPO groups run one task
  `group_size` times, and tasks come back every epoch), with at most `per_setup` ready sessions
  for it and `max_sessions` across all setups; at that bound a setup asked for more recently
  takes the place of one asked for less recently;
- backpressure both ways: the pool fills only while more than `reserve_sessions` session slots
  are free and the memory and process headroom (admission.py) holds two more sessions, one fill
  at a time and none while a request's create runs (it works in idle time, never competing with
  demand for CPU or capacity); and a create refused with 429 (session cap or no headroom) while
  warm sessions are idle deletes the oldest of the least recently asked setup and tries again,
  so warm sessions never cause a 429;
- a warm session that the idle TTL removed (or that was deleted) is skipped, never handed out;
  a setup whose warm-up failed (setup_failed) is not warmed again (requests for it still run it).

`per_setup` 0 turns the pool off: `create` is `SessionManager.create`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from services.sandbox import metrics
from services.sandbox.limits import Limits
from services.sandbox.sessions.manager import SessionManager
from services.sandbox.sessions.session import Session, SessionError
from shellrl.contract.exec import ExecResult

log = logging.getLogger(__name__)
MAX_TRACKED_SETUPS = 1024  # distinct setup keys whose demand is remembered (LRU)
REFILL_POLL_S = 1.0  # the filler looks again this often without a wake-up (TTL, freed headroom)


@dataclass(frozen=True)
class SetupSpec:
    """What a session is created from; `key` names it (16 hex digits of sha256)."""

    setup: str
    env: tuple[tuple[str, str], ...]
    limits: Limits
    policy: str | None

    @property
    def key(self) -> str:
        text = json.dumps(
            [self.setup, self.env, self.limits.as_dict(), self.policy], sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _Demand:
    spec: SetupSpec
    requests: int = 0
    failed: bool = False


class WarmPool:
    """Ready sessions per repeating setup in front of `manager` (see the module docstring)."""

    def __init__(
        self,
        manager: SessionManager,
        *,
        per_setup: int,
        max_sessions: int,
        min_repeats: int,
        reserve_sessions: int,
    ) -> None:
        if per_setup < 0 or max_sessions < 0 or min_repeats < 1 or reserve_sessions < 0:
            raise ValueError(
                "warm pool: per_setup, max_sessions, reserve_sessions >= 0 and min_repeats >= 1"
            )
        self.manager = manager
        self.per_setup, self.max_sessions = per_setup, max_sessions
        self.min_repeats, self.reserve_sessions = min_repeats, reserve_sessions
        self.ready: dict[str, deque[tuple[Session, ExecResult]]] = {}
        self.demand: OrderedDict[str, _Demand] = OrderedDict()  # most recently asked last
        self.hits = self.misses = self.evicted = 0
        self._requests = 0  # requests' creates running now: the pool fills only when none is
        self._wake = asyncio.Event()
        self._deleting: set[asyncio.Task] = set()

    @property
    def enabled(self) -> bool:
        return self.per_setup > 0 and self.max_sessions > 0

    def size(self) -> int:
        return sum(len(q) for q in self.ready.values())

    def status(self) -> dict:
        """For /readyz: ready sessions, setups kept warm, hits and misses since start."""
        return {
            "enabled": self.enabled,
            "ready": self.size(),
            "setups": sum(1 for q in self.ready.values() if q),
            "hits": self.hits,
            "misses": self.misses,
            "evicted": self.evicted,
        }

    # ---- requests --------------------------------------------------------------------------
    async def create(
        self, setup: str, env: dict[str, str], limits: Limits, policy: str | None
    ) -> tuple[Session, ExecResult, bool]:
        """(session, its setup result, whether it came from the pool). Raises what
        `SessionManager.create` raises (400 / 422 setup_failed / 429 / 503)."""
        if not self.enabled:
            session, result = await self.manager.create(setup, env, limits, policy)
            return session, result, False
        spec = SetupSpec(setup, tuple(sorted(env.items())), limits, policy)
        key = spec.key
        self._note_demand(key, spec)
        taken = self._take(key)
        if taken is not None:
            self.hits += 1
            metrics.WARM_POOL_REQUESTS.labels("hit").inc()
            self._wake.set()  # refill
            return (*taken, True)
        self.misses += 1
        metrics.WARM_POOL_REQUESTS.labels("miss").inc()
        try:
            session, result = await self._create_making_room(spec)
        finally:
            self._wake.set()
        return session, result, False

    def _note_demand(self, key: str, spec: SetupSpec) -> None:
        entry = self.demand.pop(key, None) or _Demand(spec)
        entry.requests += 1
        self.demand[key] = entry
        while len(self.demand) > MAX_TRACKED_SETUPS:
            old, _ = self.demand.popitem(last=False)
            self._drop_setup(old)

    def _take(self, key: str) -> tuple[Session, ExecResult] | None:
        queue = self.ready.get(key)
        while queue:
            session, result = queue.popleft()
            if session.closed or session.session_id not in self.manager.sessions:
                continue  # expired (idle TTL) or deleted while warm
            session.last_used_at = time.time()
            self._gauge()
            return session, result
        self._gauge()
        return None

    async def _create_making_room(self, spec: SetupSpec) -> tuple[Session, ExecResult]:
        """`manager.create` for a request (no fill starts meanwhile); on 429, evict one idle
        warm session (oldest, of the least recently asked setup) and try once more per eviction."""
        self._requests += 1
        try:
            return await self._create_evicting(spec)
        finally:
            self._requests -= 1

    async def _create_evicting(self, spec: SetupSpec) -> tuple[Session, ExecResult]:
        while True:
            try:
                return await self.manager.create(
                    spec.setup, dict(spec.env), spec.limits, spec.policy
                )
            except SessionError as exc:
                if exc.status != 429 or not await self._evict_one():
                    raise

    async def _evict_one(self, before: str | None = None) -> bool:
        """Delete the oldest warm session of the least recently asked setup (only of setups
        asked for less recently than `before`, when given); False if there is none."""
        for key in list(self.demand):  # least recently asked first
            if key == before:
                return False
            queue = self.ready.get(key)
            while queue:
                session, _ = queue.popleft()
                if session.closed or session.session_id not in self.manager.sessions:
                    continue
                await self._delete(session)
                self.evicted += 1
                metrics.WARM_POOL_EVICTIONS.inc()
                self._gauge()
                return True
        return False

    # ---- filling ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Fill until cancelled: after every create and every REFILL_POLL_S."""
        if not self.enabled:
            return
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), REFILL_POLL_S)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                while await self.fill_one():
                    pass
            except Exception:  # one failed warm-up must not stop the pool
                log.exception("warm pool fill failed")

    async def fill_one(self) -> bool:
        """Create one warm session for the most recently asked setup that lacks some, if the
        headroom allows; at `max_sessions`, only by evicting one of a setup asked for less
        recently. True when one was made (or a setup was found failing)."""
        if self._requests or not self._headroom_allows():
            return False
        key = self._next_to_fill()
        if key is None:
            return False
        if self.size() >= self.max_sessions and not await self._evict_one(before=key):
            return False
        entry = self.demand[key]
        spec = entry.spec
        try:
            session, result = await self.manager.create(
                spec.setup, dict(spec.env), spec.limits, spec.policy
            )
        except SessionError as exc:
            if exc.status == 422:
                entry.failed = True
                log.info("warm pool: setup failed, not warming it", extra={"setup_key": key})
                return True  # others may still be filled
            return False  # 429 / 503: no room now
        if key not in self.demand:  # dropped while it was being set up
            await self._delete(session)
            return True
        self.ready.setdefault(key, deque()).append((session, result))
        metrics.WARM_POOL_FILLS.inc()
        self._gauge()
        return True

    def _next_to_fill(self) -> str | None:
        for key in reversed(self.demand):  # most recently asked first
            entry = self.demand[key]
            if entry.failed or entry.requests < self.min_repeats:
                continue
            if len(self.ready.get(key, ())) < self.per_setup:
                return key
        return None

    def _headroom_allows(self) -> bool:
        room = self.manager.headroom()
        admission = self.manager.admission
        return (
            room["sessions"] > self.reserve_sessions
            and room["memory_bytes"] >= 2 * admission.session_memory_bytes
            and room["pids"] >= 2 * self.manager.default_limits.pids
        )

    def _drop_setup(self, key: str) -> None:
        for session, _ in self.ready.pop(key, ()):
            if not session.closed:
                task = asyncio.get_running_loop().create_task(self._delete(session))
                self._deleting.add(task)  # held until done (the loop keeps only weak references)
                task.add_done_callback(self._deleting.discard)
        self._gauge()

    async def _delete(self, session: Session) -> None:
        try:
            await self.manager.delete(session.session_id)
        except SessionError:
            pass  # already gone

    def _gauge(self) -> None:
        metrics.WARM_POOL_SESSIONS.set(self.size())
