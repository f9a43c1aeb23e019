"""cgroup v2 layout (one unified hierarchy at `<root>`, with the memory and pids controllers, and
cpu where available, enabled down to the sessions).

    <root>/shellrl-sandbox/block-<first uid>/   memory.max, pids.max, cpu.max of all sessions
        u<uid>/                                 the session's limits; its launcher and runner
        u<uid>/cmds/                            its commands (no controllers of its own)

v2 moves a process only where the writer may write `cgroup.procs` of the source's and target's
common ancestor, so the launcher (still root) joins `u<uid>` before it execs (`launcher_procs`,
isolation/launch.py) and commands, started by the runner inside `u<uid>`, join `cmds` (both files
chowned to the session uid). Under bubblewrap the cgroup namespace is rooted at `u<uid>`. Killing
the commands (`cgroup.kill` on `cmds`) spares the runner; removing the session kills `u<uid>`.
"""

from __future__ import annotations

import logging
import os
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
REQUIRED = ("memory", "pids")
OPTIONAL = ("cpu",)
COMMANDS = "cmds"


def _set_limits(group: Path, limits: CgroupLimits) -> None:
    write(group / "memory.max", str(limits.memory_bytes))
    if (group / "memory.swap.max").exists():
        write(group / "memory.swap.max", "0")
    write(group / "pids.max", str(limits.pids))
    if (group / "cpu.max").exists():
        write(group / "cpu.max", f"{limits.cpu_quota_us()} {CPU_PERIOD_US}")


def _enable(group: Path, controllers: list[str]) -> None:
    """Enable `controllers` for the children of `group` (those not enabled yet)."""
    enabled = set((group / "cgroup.subtree_control").read_text().split())
    for controller in controllers:
        if controller not in enabled:
            write(group / "cgroup.subtree_control", f"+{controller}")


class V2SessionCgroup:
    """`u<uid>` of one session and its `cmds` child (module doc)."""

    def __init__(self, group: Path) -> None:
        self.group = group
        self.commands = group / COMMANDS
        self.procs_files = (self.commands / "cgroup.procs",)
        self.launcher_procs: Path | None = group / "cgroup.procs"

    def exists(self) -> bool:
        return self.group.exists()

    def create(self, uid: int, limits: CgroupLimits) -> None:
        if self.exists():
            self.remove()
        self.group.mkdir()
        _set_limits(self.group, limits)
        self.commands.mkdir()
        for procs in (self.group / "cgroup.procs", self.commands / "cgroup.procs"):
            os.chown(procs, uid, uid)

    def pids(self) -> list[int]:
        """Processes of the session's commands (not its launcher and runner)."""
        return read_pids(self.commands / "cgroup.procs")

    def _kill(self, group: Path, deadline_s: float) -> int:
        """Every process in `group` and below: `cgroup.kill`, or where the kernel has none (before
        5.14) freeze, SIGKILL each, thaw; until empty. Returns the processes seen."""
        seen = 0

        def kill_round() -> bool:
            nonlocal seen
            pids = [p for d, _, _ in os.walk(group) for p in read_pids(Path(d) / "cgroup.procs")]
            if not pids:
                return True
            seen += len(pids)
            try:
                write(group / "cgroup.kill", "1")
                return False
            except FileNotFoundError:
                pass
            write(group / "cgroup.freeze", "1")
            sigkill_each(pids)
            write(group / "cgroup.freeze", "0")
            return False

        try:
            emptied = until_empty(kill_round, deadline_s)
        except FileNotFoundError:  # the group is gone
            return seen
        if not emptied:
            log.error("processes survived the cgroup kill", extra={"group": str(group)})
        return seen

    def kill_all(self, deadline_s: float = 2.0) -> int:
        """Every process of the session's commands (the runner lives on)."""
        return self._kill(self.commands, deadline_s)

    def remove(self) -> None:
        self._kill(self.group, 2.0)
        rmdir(self.commands)
        rmdir(self.group)


class V2Hierarchy(ParentLayout):
    version = "v2"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.controllers: list[str] = []
        self.note: str | None = None

    @staticmethod
    def mounted(root: Path) -> bool:
        return (Path(root) / "cgroup.controllers").exists()

    def problem(self) -> str | None:
        """None when memory and pids (and cpu, if there) can be enabled below the root."""
        available = set((self.root / "cgroup.controllers").read_text().split())
        missing = [c for c in REQUIRED if c not in available]
        if missing:
            return (
                f"controllers {','.join(missing)} not available at {self.root} "
                "(not delegated, or bound to a v1 hierarchy)"
            )
        self.controllers = [c for c in REQUIRED + OPTIONAL if c in available]
        self.note = None if "cpu" in available else "v2 cpu controller not delegated: no CPU quota"
        try:
            _enable(self.root, self.controllers)
        except OSError as exc:
            return (
                f"cannot enable {','.join(self.controllers)} in {self.root}/cgroup.subtree_control"
                f" ({exc.strerror}; a cgroup with processes cannot delegate controllers: run the "
                "service's processes in a child cgroup of the container's)"
            )
        return None

    def _parent(self, instance: str) -> Path:
        return self.root / GROUP_DIR / instance

    def parent_dir(self, instance: str, controller: str) -> Path:
        return self._parent(instance)  # one group holds every controller

    def parent_dirs(self, instance: str) -> list[Path]:
        return [self._parent(instance)]

    def _make_parents(self, instance: str) -> None:
        top = self.root / GROUP_DIR
        top.mkdir(exist_ok=True)
        _enable(top, self.controllers)
        self._parent(instance).mkdir(exist_ok=True)

    def _limit_parents(self, instance: str, limits: CgroupLimits) -> None:
        _set_limits(self._parent(instance), limits)
        _enable(self._parent(instance), self.controllers)

    def session(self, instance: str, name: str) -> V2SessionCgroup:
        return V2SessionCgroup(self._parent(instance) / name)

    def legacy_session(self, name: str) -> None:
        return None  # the layout without a parent was v1 only
