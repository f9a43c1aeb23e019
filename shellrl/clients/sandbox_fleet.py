"""Several sandbox services (one per host or pod) behind the API of one `SandboxClient`.

    async with SandboxFleet("http://10.0.0.5:8101,http://10.0.0.6:8101") as sandbox:
        session, waited_s = await sandbox.create_session_when_free(poll_s=0.5, setup="...")
        await sandbox.exec(session["session_id"], "ls")   # goes to the service that owns it

A session lives on one service. New sessions go to the member with the most free session slots:
its /readyz `headroom.sessions` (read at most every `refresh_s`, lazily, by the create that
finds it old) less the sessions this client created there since that read; ties go round robin.
A member that answered 429 (SandboxBusy: session cap or no memory/process headroom, see
services/sandbox/sessions/admission.py) is skipped until its Retry-After has passed, one that did not
answer (connection error, 5xx) for `down_s`; the create moves on to the next member. When every
member is busy, `create_session_when_free` waits until the first Retry-After ends (at least
`poll_s`, with jitter so waiting episodes do not return at once) and tries again: admission
slows, episodes do not fail. `waiting` (creates waiting now) and `status()` show it.

Routing by session id: with more than one member a session id is `<member key>.<the service's
id>`, the key being 8 hex digits of sha256 over the member's URL, so every process configured
with the same URL list (the rollout gateway, the verifier) routes any id to its owner without a
shared table. With one member ids are the service's own (a fleet of one is a `SandboxClient`).
An id naming no member is SandboxNotFound (404). Errors are those of shellrl.clients.sandbox.

Members that register themselves (`registry_url`: the Redis of `shellrl:sandboxes`,
shellrl.clients.sandbox_registry) join at run time, read with the /readyz readings (every
`refresh_s`, and at once for an id naming an unknown member); a registered member that is leaving
or whose registration lapsed takes no new session but still serves the ones it owns. With a
registry, ids always carry the member key.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx

from shellrl import streams
from shellrl.clients.sandbox import (
    SandboxBadRequest,
    SandboxBusy,
    SandboxClient,
    SandboxError,
    SandboxNotFound,
)
from shellrl.clients.sandbox_registry import read_registrations
from shellrl.contract.exec import ExecResult

log = logging.getLogger(__name__)

SEPARATOR = "."
DEFAULT_RETRY_AFTER_S = 2.0  # a 429 without Retry-After
READY_TIMEOUT_S = 2.0  # a /readyz read (a probe must not hang on an unreachable member)
JITTER = 0.25  # a waiting create sleeps its wait times uniform(1, 1 + JITTER)


def member_key(url: str) -> str:
    """8 hex digits of sha256 over the URL (trailing '/' dropped): the session id prefix."""
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:8]


def parse_urls(urls: Sequence[str] | str) -> list[str]:
    """A comma-separated string or a list -> the URLs, stripped, without trailing '/', in order,
    duplicates dropped. ValueError when none is left."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = list(dict.fromkeys(u.strip().rstrip("/") for u in items if u.strip()))
    if not out:
        raise ValueError("a sandbox fleet needs at least one sandbox URL")
    return out


@dataclass
class Member:
    """One sandbox service as this client sees it."""

    url: str
    client: SandboxClient
    key: str
    free_sessions: int | None = None  # /readyz headroom.sessions at the last read
    created_since_read: int = 0
    read_at: float = float("-inf")  # monotonic s of the last /readyz read
    busy_until: float = 0.0  # monotonic s: a 429's Retry-After
    down_until: float = 0.0  # monotonic s: no answer
    created: int = 0
    refused: int = 0
    last_reason: str | None = None  # details.reason of its last 429
    registered: bool = False  # joined through the registry
    gone: bool = False  # registered, then leaving or lapsed: no new sessions

    def free(self) -> float:
        if self.free_sessions is None:
            return float("inf")  # unknown: worth a try
        return self.free_sessions - self.created_since_read

    def available(self, now: float) -> bool:
        return not self.gone and now >= self.busy_until and now >= self.down_until


class SandboxFleet:
    """The sandbox services at `urls` (see the module docstring). timeout_s, api_token and
    transport are each member's SandboxClient's; refresh_s: how old a member's /readyz (and the
    registry) may be when a create picks; down_s: how long a member that did not answer is
    skipped; registry_url: Redis holding `shellrl:sandboxes` (None: the `urls` only, which may
    then not be empty)."""

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        timeout_s: float = 30.0,
        api_token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        refresh_s: float = 1.0,
        down_s: float = 5.0,
        registry_url: str | None = None,
    ) -> None:
        self._client_args = (timeout_s, transport, api_token)
        self.members: list[Member] = []
        self.by_key: dict[str, Member] = {}
        items = urls.split(",") if isinstance(urls, str) else list(urls)
        if registry_url is None or any(u.strip() for u in items):  # none: registered ones only
            for url in parse_urls(items):
                self._add(url)
        self.timeout_s, self.refresh_s, self.down_s = timeout_s, refresh_s, down_s
        self.registry = None if registry_url is None else streams.connect(registry_url)
        self._registry_read_at = float("-inf")
        self.prefixed = len(self.members) > 1 or self.registry is not None
        self.waiting = 0  # creates waiting now because every member is busy
        self.waits_total = 0
        self.wait_seconds_total = 0.0
        self._turn = itertools.count()
        self._refresh_lock = asyncio.Lock()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(m.client.aclose() for m in self.members))
        if self.registry is not None:
            await self.registry.aclose()

    def _add(self, url: str, registered: bool = False) -> Member:
        member = Member(
            url, SandboxClient(url, *self._client_args), member_key(url), registered=registered
        )
        if member.key in self.by_key:
            raise ValueError(f"two sandbox URLs share the member key of {url}; use distinct URLs")
        self.members.append(member)
        self.by_key[member.key] = member
        return member

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    # ---- sessions ----------------------------------------------------------------------------
    async def create_session(self, **session: Any) -> dict[str, Any]:
        """POST /v1/sessions on the least loaded available member (module docstring); the
        session's id is routable by this fleet and `sandbox_url` names its member. Raises
        SandboxBusy when every member is busy (its `retry_after_s`: until the first frees),
        SandboxError when none answered, and the owner's SandboxSetupFailed/SandboxBadRequest."""
        await self._refresh()
        now = time.monotonic()
        busy: SandboxBusy | None = None
        error: SandboxError | None = None
        for member in self._by_load(now):
            try:
                created = await member.client.create_session(**session)
            except SandboxBusy as exc:
                if self.prefixed:  # skipped for its Retry-After; with one member, poll_s rules
                    retry_s = exc.retry_after_s or DEFAULT_RETRY_AFTER_S
                    member.busy_until = time.monotonic() + retry_s
                member.refused += 1
                member.last_reason = ((exc.body.get("error") or {}).get("details") or {}).get(
                    "reason"
                )
                busy = exc
                continue
            except (SandboxBadRequest, SandboxNotFound):
                raise  # the request's fault (or its setup's): another member would say the same
            except SandboxError as exc:
                if self.prefixed:  # skipped for down_s; a fleet of one tries it every time
                    member.down_until = time.monotonic() + self.down_s
                error = exc
                continue
            member.created += 1
            member.created_since_read += 1
            if self.prefixed:
                created["session_id"] = f"{member.key}{SEPARATOR}{created['session_id']}"
            created["sandbox_url"] = member.url
            return created
        live = [m for m in self.members if not m.gone]
        if busy is None and error is not None:
            raise error
        if busy is None and live and all(m.down_until > now for m in live):
            raise SandboxError(f"no sandbox service answers ({self.urls})")
        raise self._all_busy(busy)  # at capacity (or none registered yet): wait

    async def create_session_when_free(
        self,
        *,
        poll_s: float,
        max_poll_s: float | None = None,
        attempts: int | None = None,
        **session: Any,
    ) -> tuple[dict[str, Any], float]:
        """`create_session(**session)`, waiting while every member is busy: until the first
        member's Retry-After ends, at least `poll_s` (doubling per wait up to `max_poll_s`; None:
        a fixed poll_s) and at most `max_poll_s`; at most `attempts` tries (None: until a session
        is free). Returns (the
        session, seconds spent waiting). Raises what create_session raises, SandboxBusy after
        the last attempt."""
        first = time.monotonic()
        waited_s = 0.0
        for attempt in itertools.count(1):
            try:
                return await self.create_session(**session), waited_s
            except SandboxBusy as exc:
                if attempts is not None and attempt >= attempts:
                    raise
                backoff_s = poll_s if max_poll_s is None else poll_s * 2 ** min(attempt - 1, 30)
                wait_s = max(backoff_s, exc.retry_after_s or 0.0)
                if max_poll_s is not None:
                    wait_s = min(wait_s, max_poll_s)
                wait_s *= random.uniform(1.0, 1.0 + JITTER)
            self.waiting += 1
            self.waits_total += attempt == 1
            try:
                await asyncio.sleep(wait_s)
            finally:
                self.waiting -= 1
                self.wait_seconds_total += wait_s
            waited_s = time.monotonic() - first
        raise AssertionError("unreachable")

    async def exec(
        self,
        session_id: str,
        command: str,
        timeout_s: float | None = None,
        fresh_state: bool = False,
    ) -> ExecResult:
        """SandboxClient.exec on the session's owner."""
        member, raw = await self._owner(session_id)
        return await member.client.exec(raw, command, timeout_s=timeout_s, fresh_state=fresh_state)

    async def diff(self, session_id: str, max_paths: int = 1000) -> dict[str, Any]:
        """SandboxClient.diff on the session's owner (files changed since setup)."""
        member, raw = await self._owner(session_id)
        return await member.client.diff(raw, max_paths=max_paths)

    async def read_file(self, session_id: str, path: str, max_bytes: int = 10 << 20) -> bytes:
        member, raw = await self._owner(session_id)
        return await member.client.read_file(raw, path, max_bytes=max_bytes)

    async def session_info(self, session_id: str) -> dict[str, Any]:
        member, raw = await self._owner(session_id)
        return await member.client.session_info(raw)

    async def kill_processes(self, session_id: str) -> dict[str, Any]:
        member, raw = await self._owner(session_id)
        return await member.client.kill_processes(raw)

    async def reset(self, session_id: str) -> dict[str, Any]:
        member, raw = await self._owner(session_id)
        return await member.client.reset(raw)

    async def delete(self, session_id: str) -> None:
        member, raw = await self._owner(session_id)
        await member.client.delete(raw)

    async def ready(self) -> dict[str, Any]:
        """{"ready": some member is ready, "members": {url: its /readyz or the error}}."""
        answers = await asyncio.gather(
            *(asyncio.wait_for(m.client.ready(), READY_TIMEOUT_S) for m in self.members),
            return_exceptions=True,
        )
        members = {
            m.url: a if isinstance(a, dict) else {"ready": False, "error": str(a)}
            for m, a in zip(self.members, answers, strict=True)
        }
        return {"ready": any(a.get("ready", True) for a in members.values()), "members": members}

    def status(self) -> dict[str, Any]:
        """For the rollout /v1/status: per member its load and state; the creates waiting now."""
        now = time.monotonic()
        return {
            "waiting": self.waiting,
            "waits_total": self.waits_total,
            "wait_seconds_total": round(self.wait_seconds_total, 3),
            "members": [
                {
                    "url": m.url,
                    "free_sessions": None if m.free_sessions is None else max(0, m.free()),
                    "created": m.created,
                    "refused": m.refused,
                    "busy_for_s": round(max(0.0, m.busy_until - now), 3),
                    "down_for_s": round(max(0.0, m.down_until - now), 3),
                    "last_refusal_reason": m.last_reason,
                    "registered": m.registered,
                    "gone": m.gone,
                }
                for m in self.members
            ],
        }

    # ---- internals -----------------------------------------------------------------------------
    async def _owner(self, session_id: str) -> tuple[Member, str]:
        if not self.prefixed:
            return self.members[0], session_id
        key, sep, raw = session_id.partition(SEPARATOR)
        if sep and key not in self.by_key and self.registry is not None:
            await self._read_registry()  # a member that joined since the last reading
        member = self.by_key.get(key) if sep else None
        if member is None or not raw:
            message = f"session {session_id!r} names no sandbox of this fleet ({self.urls})"
            body = {"error": {"code": "session_not_found", "message": message, "field": None}}
            raise SandboxNotFound(message, 404, body)
        return member, raw

    def _by_load(self, now: float) -> list[Member]:
        """Available members, most free session slots first, ties in round-robin order."""
        turn = next(self._turn)
        n = len(self.members)
        ranked = [
            (-m.free(), (i - turn) % n, m) for i, m in enumerate(self.members) if m.available(now)
        ]
        return [m for *_, m in sorted(ranked, key=lambda r: r[:2])]

    def _all_busy(self, last: SandboxBusy | None) -> SandboxBusy:
        """SandboxBusy with `retry_after_s` = until the first member is tried again (None when
        none is skipped: a fleet of one)."""
        now = time.monotonic()
        ends = [max(m.busy_until, m.down_until) for m in self.members if not m.gone]
        retry_after_s = (max(0.0, min(ends) - now) or None) if ends else None
        message = f"every sandbox service is at capacity ({self.urls}); retry later"
        body = last.body if last is not None else {}
        busy = SandboxBusy(message, 429, body)
        busy.retry_after_s = retry_after_s
        return busy

    async def _read_registry(self) -> None:
        """Members from `shellrl:sandboxes`: new live ones join; registered ones that are leaving
        or lapsed take no new session (Redis errors keep the last view)."""
        self._registry_read_at = time.monotonic()
        try:
            live = await read_registrations(self.registry)
        except Exception as exc:  # Redis away: the last view stays
            log.warning("reading shellrl:sandboxes failed", extra={"error": str(exc)})
            return
        for url, registration in live.items():
            if member_key(url) not in self.by_key:
                self._add(url, registered=True)
        for member in self.members:
            if member.registered:
                registration = live.get(member.url)
                member.gone = registration is None or registration.leaving

    async def _refresh(self) -> None:
        """Read the registry and the /readyz of the members whose reading is older than
        refresh_s (one reader)."""
        if (
            self.registry is not None
            and time.monotonic() - self._registry_read_at >= self.refresh_s
        ):
            await self._read_registry()
        now = time.monotonic()
        stale = [m for m in self.members if now - m.read_at >= self.refresh_s]
        if not self.prefixed or not stale or self._refresh_lock.locked():
            return
        async with self._refresh_lock:
            answers = await asyncio.gather(
                *(asyncio.wait_for(m.client.ready(), READY_TIMEOUT_S) for m in stale),
                return_exceptions=True,
            )
            read_at = time.monotonic()
            for member, answer in zip(stale, answers, strict=True):
                member.read_at = read_at
                if isinstance(answer, dict):
                    free = (answer.get("headroom") or {}).get("sessions")
                    warm = (answer.get("warm_pool") or {}).get("ready", 0)  # given up on demand
                    member.free_sessions = None if free is None else int(free) + int(warm)
                    member.created_since_read = 0
                else:
                    member.free_sessions = None
                    member.down_until = read_at + self.down_s
