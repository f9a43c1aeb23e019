"""Which engine a `generate` goes to: the fleet's members, which of them take traffic now, how
loaded each is, and the marks that keep traffic away from an engine for a while.

Members are the URLs the client was built with, changed at run time by `set_members` (the rollout
gateway's engine directory: seed list plus live registrations) or `add` / `remove` (the
learner). A member takes traffic ("is routable") while it is available (`set_available`: in
rotation, served version within the staleness bound) and not marked stale. The pick among the
routable engines is the one with the fewest requests in flight from this client, ties broken
round-robin; an engine that just failed to answer is "suspect" for `suspect_s` and picked only
when no other engine is routable.

A response whose weight version is older than `version_floor(url)` (the gateway: current policy
version - max_staleness, for engines the learner reports on) marks its engine stale
(`check_version` raises `StaleEngine`); a stale engine takes no traffic until `clear_stale` (the
directory calls it once the learner confirmed a push to it after the mark). With `route_wait_s`
> 0, a pick that finds no routable engine waits that long for one (a restarted engine being
brought up to date) before it gives up.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable

from shellrl.clients.engine_responses import EngineUnavailable, GenerateResult

SUSPECT_S = 5.0  # an engine that failed to answer is picked last for this long


class EngineNotRoutable(EngineUnavailable):
    """No request was sent: the pinned engine takes no traffic now (left, out of rotation, stale,
    unknown), or no engine at all did within `route_wait_s`."""


class StaleEngine(EngineUnavailable):
    """The engine answered with weights older than the staleness bound allows; the answer was
    discarded (none of its tokens may be used) and the engine is marked stale."""

    def __init__(self, url: str, message: str, *, version: int) -> None:
        super().__init__(url, message)
        self.version = version


def weight_version_number(version: str) -> int | None:
    """An engine's `weight_version` as a policy version: "default" or "" (SGLang's unset version,
    the initial weights) -> 0, "7" -> 7, anything else -> None (not comparable)."""
    if version in ("default", ""):
        return 0
    try:
        return int(version)
    except ValueError:
        return None


class EngineRouting:
    """Members, availability, load and marks of a fleet of engine URLs (see the module docstring).
    Not thread-safe: use it from one event loop."""

    def __init__(
        self, urls: Iterable[str], *, route_wait_s: float = 0.0, suspect_s: float = SUSPECT_S
    ) -> None:
        self.urls: list[str] = []
        self.in_flight: Counter[str] = Counter()  # requests in flight from this client, per URL
        self.available: dict[str, bool] = {}
        self.suspect_until: dict[str, float] = {}  # url -> time.monotonic() when it clears
        self.stale_since: dict[str, float] = {}  # url -> time.time() of the stale answer
        # url -> the oldest weight version its answers may carry (None: not judged by version)
        self.version_floor: Callable[[str], int | None] | None = None
        self.route_wait_s, self.suspect_s = route_wait_s, suspect_s
        self._tie_break = itertools.count()
        self._changed = asyncio.Event()
        for url in urls:
            self.add(url)

    # ----- membership and marks ---------------------------------------------------------------

    def add(self, url: str, *, available: bool = True) -> None:
        """Make `url` a member (no-op when it is one); `available` applies only to a new member."""
        url = url.rstrip("/")
        if url not in self.available:
            self.urls.append(url)
            self.available[url] = available
            self._notify()

    def remove(self, url: str) -> None:
        """Drop `url` from the members: no new request goes there (requests in flight finish)."""
        url = url.rstrip("/")
        if url in self.available:
            self.urls.remove(url)
            del self.available[url]
            self.suspect_until.pop(url, None)
            self.stale_since.pop(url, None)
            self._notify()

    def set_members(self, available: dict[str, bool]) -> None:
        """Members become exactly the keys of `available` (url -> takes traffic)."""
        wanted = {u.rstrip("/"): ok for u, ok in available.items()}
        for url in [u for u in self.urls if u not in wanted]:
            self.remove(url)
        for url, ok in wanted.items():
            self.add(url, available=ok)
            self.set_available(url, ok)

    def set_available(self, url: str, available: bool) -> None:
        """Take a member out of traffic (e.g. while it loads weights) or put it back."""
        url = url.rstrip("/")
        if url not in self.available:
            raise KeyError(f"unknown engine URL {url!r}; known: {self.urls}")
        if self.available[url] != available:
            self.available[url] = available
            self._notify()

    def mark_suspect(self, url: str) -> None:
        self.suspect_until[url] = time.monotonic() + self.suspect_s

    def clear_suspect(self, url: str) -> None:
        self.suspect_until.pop(url, None)

    def clear_stale(self, url: str) -> None:
        if self.stale_since.pop(url, None) is not None:
            self._notify()

    def check_version(self, result: GenerateResult) -> None:
        """StaleEngine (after marking the engine stale) when any token of `result` was sampled
        with a weight version below `version_floor(url)`; versions that are no number pass."""
        url = result.engine_url
        floor = self.version_floor(url) if self.version_floor is not None else None
        if floor is None:
            return
        spans = [s.version for s in result.weight_versions] or [result.weight_version]
        numbers = [v for v in map(weight_version_number, spans) if v is not None]
        if numbers and min(numbers) < floor:
            if url in self.available:
                self.stale_since[url] = time.time()
                self._notify()
            raise StaleEngine(
                url,
                f"answered with weight_version {min(numbers)}, below the staleness bound's floor "
                f"{floor}; answer discarded, engine marked stale until it is updated",
                version=min(numbers),
            )

    # ----- picking ----------------------------------------------------------------------------

    def is_routable(self, url: str) -> bool:
        return bool(self.available.get(url)) and url not in self.stale_since

    def routable(self) -> list[str]:
        return [u for u in self.urls if self.is_routable(u)]

    def require(self, url: str) -> str:
        """`url` if it takes traffic now, else EngineNotRoutable (nothing is sent)."""
        url = url.rstrip("/")
        if self.is_routable(url):
            return url
        reason = (
            "not a member (left or never registered)"
            if url not in self.available
            else "stale (weights outside the staleness bound)"
            if url in self.stale_since
            else "out of rotation"
        )
        raise EngineNotRoutable(url, f"pinned engine takes no traffic: {reason}")

    def pick(self, exclude: set[str]) -> str:
        """The least-loaded routable engine not in `exclude` (all routable ones when that leaves
        none), non-suspect ones first. EngineNotRoutable when no engine is routable."""
        routable = self.routable()
        candidates = [u for u in routable if u not in exclude] or routable
        if not candidates:
            raise EngineNotRoutable(
                ",".join(self.urls) or "(no engines)",
                "no engine is routable (none is a member in rotation within the staleness bound)",
            )
        now = time.monotonic()
        healthy = [u for u in candidates if self.suspect_until.get(u, 0.0) <= now]
        candidates = healthy or candidates
        low = min(self.in_flight[u] for u in candidates)
        tied = [u for u in candidates if self.in_flight[u] == low]
        return tied[next(self._tie_break) % len(tied)]

    async def pick_when_routable(self, exclude: set[str]) -> str:
        """`pick`, waiting up to `route_wait_s` for a routable engine when there is none."""
        deadline = time.monotonic() + self.route_wait_s
        while True:
            try:
                return self.pick(exclude)
            except EngineNotRoutable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), timeout=min(left, 1.0))
                except TimeoutError:
                    pass

    def _notify(self) -> None:
        """Wake the picks waiting for a routable engine."""
        self._changed.set()
        self._changed = asyncio.Event()
