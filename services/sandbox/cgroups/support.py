"""Cgroups of the sandbox: one parent per instance bounding all its sessions, one group per session.

    <cgroup root>/shellrl-sandbox/block-<first uid>/       memory, pids and CPU of all sessions
                                                  u<uid>/  one session: memory, pids, CPU quota

The parent's limits are sized from the host (`HostCapacity` times the `sessions_*_fraction`
settings), so sessions together can never take the host's memory, process table or every core; each
session's limits sit below it. cgroup v2 is used where the root is a v2 mount with the memory and
pids controllers available (v2.py), else v1 (v1.py: pids, memory, freezer, and cpu where mounted).
Where neither is writable, `CgroupSupport.available` is False, `reason` says why (logged, in
/readyz, metric `shellrl_sandbox_cgroup_limits_enforced` 0): sessions then run without a memory or
CPU bound, processes capped by RLIMIT_NPROC of their uid only. A session's commands join its group
as their first act (isolation/preludes.py); a process cannot leave it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from services.sandbox.cgroups.base import GROUP_DIR, CgroupLimits, Usage
from services.sandbox.cgroups.v1 import V1Hierarchy
from services.sandbox.cgroups.v2 import V2Hierarchy

log = logging.getLogger(__name__)


class SessionCgroup(Protocol):
    """One session's cgroup(s); both versions implement it."""

    procs_files: tuple[Path, ...]  # a command writes "0" into each to join (session uid may)
    launcher_procs: Path | None  # root writes the launcher's pid here before it execs (v2)

    def exists(self) -> bool: ...
    def create(self, uid: int, limits: CgroupLimits) -> None: ...
    def pids(self) -> list[int]: ...
    def kill_all(self, deadline_s: float = 2.0) -> int: ...
    def remove(self) -> None: ...


class Hierarchy(Protocol):
    """One cgroup version's layout under `root` (cgroup_v1.V1Hierarchy, cgroup_v2.V2Hierarchy)."""

    version: str
    root: Path
    note: str | None  # what works only in part (a missing cpu controller), once probed

    def problem(self) -> str | None: ...
    def setup_parent(self, instance: str, limits: CgroupLimits) -> None: ...
    def session(self, instance: str, name: str) -> SessionCgroup: ...
    def usage(self, instance: str) -> Usage: ...
    def legacy_session(self, name: str) -> SessionCgroup | None: ...
    def remove_parent(self, instance: str) -> None: ...


class CgroupSupport:
    """The cgroups of one instance (`instance` names its parent), probed and set up at start-up
    with the parent `limits`; `available`, `version` ("v1"/"v2"/None) and `reason` (why not, or
    which controller is missing) say what works."""

    def __init__(self, root: Path, instance: str, limits: CgroupLimits) -> None:
        self.root, self.instance, self.limits = Path(root), instance, limits
        self.version: str | None = None
        self.reason: str | None = None
        self.hierarchy: Hierarchy | None = None
        candidates = [V2Hierarchy(self.root)] if V2Hierarchy.mounted(self.root) else []
        candidates.append(V1Hierarchy(self.root))
        problems = []
        for hierarchy in candidates:
            try:
                if (problem := hierarchy.problem()) is None:
                    hierarchy.setup_parent(instance, limits)
            except OSError as exc:
                problem = f"cannot set up {hierarchy.root / GROUP_DIR / instance}: {exc}"
            if problem is None:
                self.hierarchy, self.version = hierarchy, hierarchy.version
                self.reason = hierarchy.note
                break
            problems.append(f"{hierarchy.version}: {problem}")
        if self.hierarchy is None:
            self.reason = "; ".join(problems)
            log.warning(
                "cgroups unavailable: sessions run without memory or CPU limits and without a "
                "bound on all sessions together (processes: RLIMIT_NPROC per session uid only)",
                extra={"reason": self.reason},
            )
        else:
            log.info(
                "session cgroups ready",
                extra={"version": self.version, "parent": limits.as_dict(), "note": self.reason},
            )

    @property
    def available(self) -> bool:
        return self.hierarchy is not None

    def group(self, name: str) -> SessionCgroup | None:
        return self.hierarchy.session(self.instance, name) if self.hierarchy else None

    def legacy_group(self, name: str) -> SessionCgroup | None:
        """The group a session named `name` had in the layout without a parent (clean-up)."""
        return self.hierarchy.legacy_session(name) if self.hierarchy else None

    def usage(self) -> Usage | None:
        """What all sessions of this instance use now (None without cgroups)."""
        return self.hierarchy.usage(self.instance) if self.hierarchy else None

    def remove(self) -> None:
        """Remove the instance's parent and every session group below it (at shutdown)."""
        if self.hierarchy is not None:
            self.hierarchy.remove_parent(self.instance)

    def session_limits(self, memory_bytes: int, pids: int, cpus: float) -> CgroupLimits:
        """A session's limits, its CPU quota at most the parent's (v1 refuses a larger one)."""
        return CgroupLimits(memory_bytes, pids, min(cpus, self.limits.cpus))

    def details(self) -> dict:
        """For /readyz: version, the parent's limits, and why not / what is missing."""
        limits = self.limits.as_dict() if self.available else None
        return {
            "cgroup_version": self.version,
            "cgroup_parent": limits,
            "cgroup_reason": self.reason,
        }
