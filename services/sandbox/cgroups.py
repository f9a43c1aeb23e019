"""Per-session cgroups (v1: pids, memory, freezer) — process cap, memory cap, whole-tree kill.

A session's commands join its cgroup as their first act (see `preludes.py`), so every process
they start, including `setsid`/double-fork escapes, stays countable and killable: a process
cannot leave a v1 cgroup whose parent's `cgroup.procs` it cannot write.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from pathlib import Path

from tenacity import (
    Retrying,
    retry,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_fixed,
)

log = logging.getLogger(__name__)

CONTROLLERS = ("pids", "memory", "freezer")
GROUP_DIR = "shellrl-sandbox"


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@retry(
    retry=retry_if_exception(lambda exc: isinstance(exc, OSError) and exc.errno == errno.EBUSY),
    stop=stop_after_attempt(100),
    wait=wait_fixed(0.01),
    retry_error_callback=lambda _state: None,
)
def _rmdir(group_dir: Path) -> None:
    """rmdir one cgroup; EBUSY (its last processes still exiting) is retried every 10 ms, 100 times
    at most, then the directory is left. A missing directory is fine; other OSErrors raise."""
    try:
        group_dir.rmdir()
    except FileNotFoundError:
        pass


class CgroupSupport:
    """What the start-up probe found: usable v1 controllers under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.available = self._probe()

    def _probe(self) -> bool:
        try:
            for controller in CONTROLLERS:
                parent = self.root / controller / GROUP_DIR
                parent.mkdir(exist_ok=True)
                probe = parent / f"probe-{os.getpid()}"
                probe.mkdir(exist_ok=True)
                probe.rmdir()
            return True
        except OSError as exc:
            log.warning(
                "cgroups v1 unavailable; process cap falls back to RLIMIT_NPROC",
                extra={"error": str(exc)},
            )
            return False

    def group(self, name: str) -> SessionCgroup | None:
        return SessionCgroup(self.root, name) if self.available else None


class SessionCgroup:
    """The cgroups of one session, named by its uid (unique per instance through the uid block lock)."""

    def __init__(self, root: Path, name: str) -> None:
        self.dirs = {c: root / c / GROUP_DIR / name for c in CONTROLLERS}

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def create(self, uid: int, pids_max: int, memory_bytes: int) -> None:
        """mkdir the groups, set limits, let `uid` move its own processes in (write on cgroup.procs)."""
        if any(d.exists() for d in self.dirs.values()):
            self.remove()
        for d in self.dirs.values():
            d.mkdir()
            os.chown(d / "cgroup.procs", uid, uid)
        _write(self.dirs["pids"] / "pids.max", str(pids_max))
        _write(self.dirs["memory"] / "memory.limit_in_bytes", str(memory_bytes))
        try:  # no swap here, but limit memory+swap where swap accounting exists
            _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", str(memory_bytes))
        except OSError:
            pass

    def pids(self) -> list[int]:
        try:
            text = (self.dirs["pids"] / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def oom_killed(self) -> int:
        try:
            for line in (self.dirs["memory"] / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def kill_all(self, deadline_s: float = 2.0) -> int:
        """Freeze, SIGKILL every member, thaw; repeat until empty. Returns the number of kills sent.

        Freezing first makes the kill atomic against forks (cgroup v1 has no `cgroup.kill`).
        """
        freezer = self.dirs["freezer"] / "freezer.state"
        sent = 0

        def kill_round() -> bool:
            """One freeze-kill-thaw pass; True when the group was already empty."""
            nonlocal sent
            pids = self.pids()
            if not pids:
                return True
            try:
                _write(freezer, "FROZEN")
            except OSError:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    sent += 1
                except ProcessLookupError:
                    pass
            try:
                _write(freezer, "THAWED")
            except OSError:
                pass
            return False

        # a pass repeats every 2 ms until one finds the group empty, for `deadline_s` at most
        empty = Retrying(
            retry=retry_if_result(lambda was_empty: not was_empty),
            stop=stop_after_delay(deadline_s),
            wait=wait_fixed(0.002),
            retry_error_callback=lambda _state: False,
        )(kill_round)
        if not empty:
            log.error("processes survived the cgroup kill", extra={"pids": self.pids()})
        return sent

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            _rmdir(d)
