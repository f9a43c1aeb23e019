"""Admission: refuse a new session or a command (429 + Retry-After) before the host runs out.

Headroom is read at each decision (a few small file reads, no syscall that blocks): memory is
the least of the sessions' parent cgroup (limit minus working set), the service's own cgroups
(a container's limit: host.OwnCgroups) and the host's MemAvailable; processes the least of the
same for pids and the host's free process slots; sessions `max_sessions` minus the live and
starting ones. A new session needs
`session_memory_bytes` of memory and its own `pids` limit of processes free; a command needs
`exec_memory_bytes` and EXEC_PIDS: it is let through on headroom read up to
EXEC_HEADROOM_MAX_AGE_S ago (reading costs ~0.3-1 ms; commands come by the hundred per second),
refused only on headroom read now. Without cgroups only the host's numbers count. Refusals are
`SessionError(429, ...)` with `retry_after_s`, counted in
`shellrl_sandbox_admission_refusals_total`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.sandbox import metrics
from services.sandbox.cgroups.support import CgroupSupport
from services.sandbox.host.capacity import HostCapacity, OwnCgroups, host_free
from services.sandbox.sessions.session import SessionError

log = logging.getLogger(__name__)
EXEC_PIDS = 8  # bash, the command, a pipeline or two
EXEC_HEADROOM_MAX_AGE_S = 0.25
MIB = 1 << 20


@dataclass(frozen=True)
class Headroom:
    """What is free now: `memory_bytes`, `pids` (processes/threads), `sessions`."""

    memory_bytes: int
    pids: int
    sessions: int

    def as_dict(self) -> dict:
        return {"memory_bytes": self.memory_bytes, "pids": self.pids, "sessions": self.sessions}


class Admission:
    """Decides whether a session or a command may start now (module doc)."""

    def __init__(
        self,
        cgroups: CgroupSupport,
        host: HostCapacity,
        max_sessions: int,
        session_memory_bytes: int,
        exec_memory_bytes: int,
        retry_after_s: int,
    ) -> None:
        self.cgroups, self.max_sessions = cgroups, max_sessions
        self.session_memory_bytes, self.exec_memory_bytes = session_memory_bytes, exec_memory_bytes
        self.retry_after_s = retry_after_s
        self.host_pids = host.pids
        self.own = OwnCgroups.find(cgroups.root)
        self._last: tuple[float, Headroom] | None = None  # (monotonic s, headroom) for execs

    def headroom(self, sessions: int) -> Headroom:
        """Free now, with `sessions` live or starting; also sets the headroom gauges."""
        memory, pids = host_free(self.host_pids, self.own)
        usage = self.cgroups.usage() if self.cgroups.available else None
        if usage is not None:
            limits = self.cgroups.limits
            memory = min(memory, limits.memory_bytes - usage.memory_bytes)
            pids = min(pids, limits.pids - usage.pids)
        room = Headroom(max(0, memory), max(0, pids), max(0, self.max_sessions - sessions))
        metrics.HEADROOM_MEMORY_BYTES.set(room.memory_bytes)
        metrics.HEADROOM_PIDS.set(room.pids)
        self._last = (time.monotonic(), room)
        return room

    def admit_session(self, sessions: int, pids: int) -> None:
        """SessionError 429 unless one more session (with a `pids` limit) fits now."""
        room = self.headroom(sessions)
        if room.sessions < 1:
            self._refuse(
                "session",
                "sessions",
                "too_many_sessions",
                f"{self.max_sessions} sessions are live (the cap); delete one or retry later",
                room,
            )
        if room.memory_bytes < self.session_memory_bytes:
            self._refuse(
                "session",
                "memory",
                "no_headroom",
                f"sandbox sessions have {room.memory_bytes // MIB} MiB of memory left; a new "
                f"session needs {self.session_memory_bytes // MIB} MiB free: retry later",
                room,
            )
        if room.pids < pids:
            self._refuse(
                "session",
                "pids",
                "no_headroom",
                f"sandbox sessions have room for {room.pids} more processes; a new session "
                f"needs {pids}: retry later",
                room,
            )

    def admit_exec(self, sessions: int) -> None:
        """SessionError 429 unless a command fits (a much lower bar than a new session): let
        through on headroom up to EXEC_HEADROOM_MAX_AGE_S old, refused on fresh headroom only."""
        last = self._last
        fresh = last is not None and time.monotonic() - last[0] < EXEC_HEADROOM_MAX_AGE_S
        if fresh and self._exec_fits(last[1]):
            return
        room = self.headroom(sessions)
        if room.memory_bytes < self.exec_memory_bytes:
            self._refuse(
                "exec",
                "memory",
                "no_headroom",
                f"sandbox sessions have {room.memory_bytes // MIB} MiB of memory left; a command "
                f"needs {self.exec_memory_bytes // MIB} MiB free: retry later",
                room,
            )
        if room.pids < EXEC_PIDS:
            self._refuse(
                "exec",
                "pids",
                "no_headroom",
                f"sandbox sessions have room for {room.pids} more processes; a command needs "
                f"{EXEC_PIDS}: retry later",
                room,
            )

    def _exec_fits(self, room: Headroom) -> bool:
        return room.memory_bytes >= self.exec_memory_bytes and room.pids >= EXEC_PIDS

    def _refuse(self, what: str, reason: str, code: str, message: str, room: Headroom) -> None:
        metrics.ADMISSION_REFUSALS.labels(what, reason).inc()
        log.info("admission refused", extra={"what": what, "reason": reason, **room.as_dict()})
        raise SessionError(
            429,
            code,
            message,
            details={"reason": reason, "headroom": room.as_dict()},
            retry_after_s=self.retry_after_s,
        )
