"""Shared pieces of the cgroup v1 and v2 layouts (cgroups.py): limits, usage, file helpers."""

from __future__ import annotations

import errno
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
