"""Shared pieces of the cgroup v1 and v2 layouts (support.py): limits, usage, file helpers, and
`ParentLayout`, the parent's set-up, removal and usage that both layouts do the same way."""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass
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

from services.sandbox.host.capacity import read_int, working_set

GROUP_DIR = "shellrl-sandbox"
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupLimits:
    """Limits of one cgroup: `memory_bytes` (no swap on top), `pids` (processes and threads),
    `cpus` (CPU time per wall-clock second: 0.5 = half a core)."""

    memory_bytes: int
    pids: int
    cpus: float

    def cpu_quota_us(self) -> int:
        """Quota per CPU_PERIOD_US period (the kernel's minimum is 1 ms)."""
        return max(1000, round(self.cpus * CPU_PERIOD_US))

    def as_dict(self) -> dict:
        return {"memory_bytes": self.memory_bytes, "pids": self.pids, "cpus": self.cpus}


@dataclass(frozen=True)
class Usage:
    """What the sessions of this instance use now: `memory_bytes` (working set: usage minus
    inactive page cache, which the kernel reclaims first), `pids`."""

    memory_bytes: int
    pids: int


def write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@retry(
    retry=retry_if_exception(lambda exc: isinstance(exc, OSError) and exc.errno == errno.EBUSY),
    stop=stop_after_attempt(100),
    wait=wait_fixed(0.01),
    retry_error_callback=lambda _state: None,
)
def rmdir(group_dir: Path) -> None:
    """rmdir one cgroup; EBUSY (its last processes still exiting) is retried every 10 ms, 100 times
    at most, then the directory is left. A missing directory is fine; other OSErrors raise."""
    try:
        group_dir.rmdir()
    except FileNotFoundError:
        pass


def read_pids(procs_file: Path) -> list[int]:
    try:
        return [int(p) for p in procs_file.read_text().split()]
    except FileNotFoundError:
        return []


def until_empty(kill_round, deadline_s: float) -> bool:
    """Run `kill_round()` (True when it found the group empty) every 2 ms until it does, for
    `deadline_s` at most; False if the group never emptied."""
    return Retrying(
        retry=retry_if_result(lambda was_empty: not was_empty),
        stop=stop_after_delay(deadline_s),
        wait=wait_fixed(0.002),
        retry_error_callback=lambda _state: False,
    )(kill_round)


def sigkill_each(pids: list[int]) -> int:
    """SIGKILL every pid of `pids` (one already gone is skipped). Returns the signals sent."""
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


class ParentLayout:
    """The instance's parent group(s) and the session groups below them, as both versions lay them
    out: a subclass says where a controller's parent directory is (`parent_dir`), which
    directories the parent is made of (`parent_dirs`: one per controller in v1, one in v2), how to
    make and limit them (`_make_parents`, `_limit_parents`) and what one session's groups are
    (`session`); this class sets them up, removes them and reads their usage."""

    root: Path

    def parent_dir(self, instance: str, controller: str) -> Path:
        raise NotImplementedError

    def parent_dirs(self, instance: str) -> list[Path]:
        raise NotImplementedError

    def session(self, instance: str, name: str):
        raise NotImplementedError

    def _make_parents(self, instance: str) -> None:
        raise NotImplementedError

    def _limit_parents(self, instance: str, limits: CgroupLimits) -> None:
        raise NotImplementedError

    def session_names(self, instance: str) -> set[str]:
        """Names of the session groups below the instance's parent directories that exist."""
        parents = [d for d in self.parent_dirs(instance) if d.exists()]
        return {p.name for d in parents for p in d.iterdir() if p.is_dir()}

    def setup_parent(self, instance: str, limits: CgroupLimits) -> None:
        """mkdir the instance's parent groups (removing what a crashed instance left below them)
        and set `limits` on them; OSError if a hierarchy is not writable."""
        self._make_parents(instance)
        for name in self.session_names(instance):
            self.session(instance, name).remove()
        self._limit_parents(instance, limits)

    def remove_parent(self, instance: str) -> None:
        """Every session group of the instance (processes killed), then its parents."""
        for name in self.session_names(instance):
            self.session(instance, name).remove()
        for parent in self.parent_dirs(instance):
            rmdir(parent)

    def usage(self, instance: str) -> Usage:
        """What the instance's sessions use now, read from its parent groups."""
        memory = working_set(self.parent_dir(instance, "memory")) or 0
        pids = read_int(self.parent_dir(instance, "pids") / "pids.current") or 0
        return Usage(max(0, memory), pids)
