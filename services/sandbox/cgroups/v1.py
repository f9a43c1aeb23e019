"""cgroup v1 layout: pids, memory and freezer (required) and cpu (where mounted), one hierarchy
each under `<root>/<controller>/`.

The session's runner stays outside the session groups; each command joins them by writing its pid
into their `cgroup.procs` through an fd the service opened (isolation/launch.py): the files stay
root's (0644), so no process of the session can move a process by path. Kill = freeze, SIGKILL every
member, thaw, until empty (v1 has no `cgroup.kill`; freezing makes it atomic against forks). A
child's CPU quota may not exceed its parent's in v1: `CgroupSupport.session_limits` clamps it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.sandbox.cgroups.base import (
    CPU_PERIOD_US,
    GROUP_DIR,
    CgroupLimits,
    ParentLayout,
    read_pids,
    rmdir,
    sigkill_each,
    until_empty,
    write,
)

log = logging.getLogger(__name__)
REQUIRED = ("pids", "memory", "freezer")
OPTIONAL = ("cpu",)


class V1SessionCgroup:
    """The groups of one session (one per controller) below `parents` {controller: dir}."""

    launcher_procs: Path | None = None

    def __init__(self, parents: dict[str, Path], name: str) -> None:
        self.dirs = {c: parent / name for c, parent in parents.items()}
        self.procs_files = tuple(d / "cgroup.procs" for d in self.dirs.values())

    def exists(self) -> bool:
        return any(d.exists() for d in self.dirs.values())

    def create(self, uid: int, limits: CgroupLimits) -> None:
        """mkdir the groups (root's: `uid` joins them only through the fds of isolation/launch.py),
        set `limits`."""
        if self.exists():
            self.remove()
        for d in self.dirs.values():
            d.mkdir()
        _set_limits(self.dirs, limits)

    def pids(self) -> list[int]:
        return read_pids(self.dirs["pids"] / "cgroup.procs")

    def kill_all(self, deadline_s: float = 2.0) -> int:
        """Freeze, SIGKILL every member, thaw; repeat until empty. Returns the kills sent."""
        freezer = self.dirs["freezer"] / "freezer.state"
        sent = 0

        def kill_round() -> bool:
            nonlocal sent
            pids = self.pids()
            if not pids:
                return True
            try:
                write(freezer, "FROZEN")
            except OSError:
                pass
            sent += sigkill_each(pids)
            try:
                write(freezer, "THAWED")
            except OSError:
                pass
            return False

        if not until_empty(kill_round, deadline_s):
            log.error("processes survived the cgroup kill", extra={"pids": self.pids()})
        return sent

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            rmdir(d)


class V1Hierarchy(ParentLayout):
    version = "v1"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.controllers = [
            c for c in REQUIRED + OPTIONAL if c in REQUIRED or (self.root / c / "tasks").exists()
        ]
        self.note = (
            None if "cpu" in self.controllers else "v1 cpu controller not mounted: no CPU quota"
        )

    def problem(self) -> str | None:
        for controller in REQUIRED:
            if not (self.root / controller / "tasks").exists():
                return f"no v1 {controller} hierarchy at {self.root / controller}"
        return None

    def parent_dir(self, instance: str, controller: str) -> Path:
        return self.root / controller / GROUP_DIR / instance

    def _parents(self, instance: str) -> dict[str, Path]:
        return {c: self.parent_dir(instance, c) for c in self.controllers}

    def parent_dirs(self, instance: str) -> list[Path]:
        return list(self._parents(instance).values())

    def _make_parents(self, instance: str) -> None:
        for parent in self.parent_dirs(instance):
            parent.mkdir(parents=True, exist_ok=True)

    def _limit_parents(self, instance: str, limits: CgroupLimits) -> None:
        _set_limits(self._parents(instance), limits)

    def session(self, instance: str, name: str) -> V1SessionCgroup:
        return V1SessionCgroup(self._parents(instance), name)

    def legacy_session(self, name: str) -> V1SessionCgroup:
        return V1SessionCgroup({c: self.root / c / GROUP_DIR for c in REQUIRED}, name)


def _set_limits(dirs: dict[str, Path], limits: CgroupLimits) -> None:
    """`limits` on one group's directories {controller: dir} (the cpu quota where mounted)."""
    write(dirs["pids"] / "pids.max", str(limits.pids))
    write(dirs["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes))
    try:  # limit memory+swap too where swap accounting exists
        write(dirs["memory"] / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
    except OSError:
        pass
    if "cpu" in dirs:
        write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        write(dirs["cpu"] / "cpu.cfs_quota_us", str(limits.cpu_quota_us()))
