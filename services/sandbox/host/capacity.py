"""What the host has for sandbox sessions: its size (memory, processes, CPUs) and what is free now.

Read from the kernel, never guessed: memory is MemTotal or the service's own cgroup limit where that
is lower (a container), processes are `kernel.pid_max` and `kernel.threads-max`, CPUs the affinity
mask or the own cgroup's CPU quota where that is lower. These size the parent cgroup of all sessions
(cgroups/support.py) and back the admission check (sessions/admission.py) where there is no cgroup.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
UNLIMITED = 1 << 62  # what "no limit" reads as below: larger than any real host


def read_small(path: Path, limit: int = 1 << 16) -> str:
    """The text of a small kernel file in one read(2) (no buffered-IO set-up: ~5x faster than
    Path.read_text for /proc and cgroup files); OSError as open(2) raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, limit).decode()
    finally:
        os.close(fd)


def stat_value(text: str, key: str) -> int:
    """The value of `key` in a "name value" per line file (memory.stat); 0 if missing."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def meminfo(proc: Path = PROC) -> dict[str, int]:
    """/proc/meminfo as {field: bytes} (the "kB" values times 1024; page counts as given)."""
    out = {}
    for line in read_small(proc / "meminfo").splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def read_int(path: Path) -> int | None:
    """An integer cgroup file; "max" and v1's near-2**63 "unlimited" read as UNLIMITED; None if
    the file is missing or unreadable."""
    try:
        text = read_small(path).strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        value = int(text.split()[0])
    except (ValueError, IndexError):
        return None
    return UNLIMITED if value >= 1 << 60 else value


def own_cgroup_dirs(
    cgroup_root: Path, controller: str, proc_self: Path = PROC / "self"
) -> list[Path]:
    """The directories of a process's cgroup (`proc_self`: this one) for `controller` and of its
    ancestors, deepest first: v2 (`0::/path` under `cgroup_root`) or v1
    (`N:...controller...:/path` under `cgroup_root/controller`). Paths outside the mount (a cgroup
    namespace) are skipped."""
    dirs = []
    for line in (proc_self / "cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            base = cgroup_root
        elif controller in controllers.split(","):
            base = cgroup_root / controller
        else:
            continue
        parts = [p for p in path.split("/") if p]
        if ".." in parts:
            continue
        dirs += [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def own_memory_limit(cgroup_root: Path) -> int:
    """The lowest memory limit on this process's cgroup path (UNLIMITED if none)."""
    limits = [UNLIMITED]
    for d in own_cgroup_dirs(cgroup_root, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            if (value := read_int(d / name)) is not None:
                limits.append(value)
    return min(limits)


def own_cpu_quota(cgroup_root: Path) -> float:
    """The lowest CPU quota on this process's cgroup path, in CPUs (math.inf if none)."""
    quotas = [math.inf]
    for d in own_cgroup_dirs(cgroup_root, "cpu"):
        try:
            quota, period = (d / "cpu.max").read_text().split()
            if quota != "max":
                quotas.append(int(quota) / int(period))
            continue
        except (OSError, ValueError):
            pass
        quota_us, period_us = read_int(d / "cpu.cfs_quota_us"), read_int(d / "cpu.cfs_period_us")
        if quota_us is not None and period_us and 0 < quota_us < UNLIMITED:
            quotas.append(quota_us / period_us)
    return min(quotas)


@dataclass(frozen=True)
class HostCapacity:
    """The host's size as far as this service may use it: `memory_bytes`, `pids` (processes and
    threads), `cpus` (may be fractional under a quota)."""

    memory_bytes: int
    pids: int
    cpus: float

    @classmethod
    def read(cls, cgroup_root: Path, proc: Path = PROC) -> HostCapacity:
        """From /proc and the service's own cgroups (module doc); OSError if /proc is unreadable."""
        memory = min(meminfo(proc)["MemTotal"], own_memory_limit(cgroup_root))
        pids = min(
            int((proc / "sys/kernel/pid_max").read_text()),
            int((proc / "sys/kernel/threads-max").read_text()),
        )
        cpus = min(float(len(os.sched_getaffinity(0))), own_cpu_quota(cgroup_root))
        return cls(memory, pids, cpus)

    def as_dict(self) -> dict:
        return {"memory_bytes": self.memory_bytes, "pids": self.pids, "cpus": self.cpus}


def working_set(directory: Path) -> int | None:
    """Memory a cgroup (v2 or v1) uses minus its inactive page cache, which the kernel reclaims
    first; None if unreadable."""
    for usage_file, key in (("memory.current", "inactive_file"), ("memory.usage_in_bytes", "")):
        usage = read_int(directory / usage_file)
        if usage is None:
            continue
        try:
            stat = read_small(directory / "memory.stat")
        except OSError:
            return usage
        return usage - stat_value(stat, key or "total_inactive_file")
    return None


def _memory_limit(directory: Path) -> int:
    values = [read_int(directory / n) for n in ("memory.max", "memory.limit_in_bytes")]
    return min([v for v in values if v] or [UNLIMITED])


@dataclass(frozen=True)
class OwnCgroups:
    """The service's own cgroup path (and ancestors) for memory and pids: in a container, its
    limits bound everything the service starts, sessions included, even where the service cannot
    create cgroups of its own."""

    memory_dirs: tuple[Path, ...]
    pids_dirs: tuple[Path, ...]

    @classmethod
    def find(cls, cgroup_root: Path, proc_self: Path = PROC / "self") -> OwnCgroups:
        """Of this process (`proc_self`: of another one, for tests); only the groups that have a
        limit now are kept (a limit set later is not seen)."""
        try:
            memory = own_cgroup_dirs(cgroup_root, "memory", proc_self)
            pids = own_cgroup_dirs(cgroup_root, "pids", proc_self)
        except OSError:
            return cls((), ())
        memory = [d for d in memory if _memory_limit(d) < UNLIMITED]
        pids = [d for d in pids if (read_int(d / "pids.max") or UNLIMITED) < UNLIMITED]
        return cls(tuple(memory), tuple(pids))

    def free(self) -> tuple[int, int]:
        """(memory bytes, processes) left below the tightest limit on the path (UNLIMITED if
        none)."""
        memory = pids = UNLIMITED
        for d in self.memory_dirs:
            if (used := working_set(d)) is not None:
                memory = min(memory, _memory_limit(d) - used)
        for d in self.pids_dirs:
            limit, current = read_int(d / "pids.max"), read_int(d / "pids.current")
            if limit is not None and current is not None:
                pids = min(pids, limit - current)
        return memory, pids


def host_free(pid_limit: int, own: OwnCgroups | None = None, proc: Path = PROC) -> tuple[int, int]:
    """(memory bytes, processes) that can still be used, now: the host's MemAvailable, and
    `pid_limit` (HostCapacity.pids) minus the threads alive (/proc/loadavg's 4th field), lowered
    to what the service's own cgroups (`own`) have left."""
    text = read_small(proc / "meminfo", 512)  # MemAvailable is the third line
    available = int(text.split("MemAvailable:")[1].split()[0]) * 1024
    threads = int(read_small(proc / "loadavg").split()[3].split("/")[1])
    if own is None:
        return available, pid_limit - threads
    own_memory, own_pids = own.free()
    return min(available, own_memory), min(pid_limit - threads, own_pids)
