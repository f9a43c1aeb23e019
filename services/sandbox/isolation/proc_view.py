"""What a session sees of the host through /proc, reduced per layer (issue 17, item 9).

* Processes: bubblewrap and unshare have their own pid namespace and /proc (only the session's
  processes). The fallback shares the host's pid namespace: `hide_other_processes` mounts, in
  the service's private mount namespace, a new /proc instance with `hidepid=2`, so a session uid
  sees only its own processes (no other command lines; environments were already unreadable).
* Kernel and host details: the files and directories Docker masks by default that exist here
  (`MASKED_FILES`, `MASKED_DIRS`) plus `/proc/cmdline` (the host kernel's command line) and
  `/proc/kallsyms` (kernel symbol addresses, where kptr_restrict lets them show) are
  covered with an empty read-only file or tmpfs in every layer (they read as empty).
* Host load and size: bubblewrap and unshare get a /proc/meminfo sized to the session's memory
  limit (`session_meminfo`, MemTotal = MemFree = MemAvailable = `memory_bytes`) and a neutral
  /proc/loadavg (`LOADAVG`).
* Mounts: bubblewrap binds only files on tmpfs mounts made for the purpose (workspace/files.py), so
  /proc/self/mountinfo names no host path and no session id.

What stays visible (README, Security, "Not promised"): /proc/stat, cpuinfo, uptime, vmstat,
pressure and the other host-wide counters in every layer; the fallback's meminfo/loadavg and
mountinfo (the service's mounts, which name session uids); the host uid of the session, which is
its uid inside too.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from services.sandbox.host import mounts
from services.sandbox.host.capacity import meminfo

log = logging.getLogger(__name__)
# Docker's default MaskedPaths (moby oci/defaults.go) plus the kernel command line and symbols
MASKED_FILES = (
    "cmdline",
    "interrupts",
    "kallsyms",
    "kcore",
    "keys",
    "latency_stats",
    "sched_debug",
    "timer_list",
    "timer_stats",
)
MASKED_DIRS = ("acpi", "asound", "scsi")
LOADAVG = "0.00 0.00 0.00 1/1 1\n"
_KEEP_HOST_VALUE = ("Hugepagesize",)
_SESSION_SIZED = ("MemTotal", "MemFree", "MemAvailable", "CommitLimit")
MS_NOEXEC = 0x8


def masks(proc: Path = Path("/proc")) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(files, directories) of MASKED_FILES / MASKED_DIRS that exist in this kernel's /proc
    (a bind needs an existing target)."""
    files = tuple(f for f in MASKED_FILES if (proc / f).is_file())
    dirs = tuple(d for d in MASKED_DIRS if (proc / d).is_dir())
    return files, dirs


def session_meminfo(memory_bytes: int, proc: Path = Path("/proc")) -> str:
    """/proc/meminfo for a session: the host's fields in the host's order, MemTotal, MemFree,
    MemAvailable and CommitLimit = `memory_bytes`, Hugepagesize kept, everything else 0."""
    lines = []
    for name, value in meminfo(proc).items():
        if name in _SESSION_SIZED:
            value = memory_bytes
        elif name not in _KEEP_HOST_VALUE:
            value = 0
        if name.startswith("HugePages_"):
            lines.append(f"{name + ':':<16}{value:>8}")
        else:
            lines.append(f"{name + ':':<16}{value // 1024:>8} kB")
    return "\n".join(lines) + "\n"


def install(runtime: Path) -> tuple[Path, Path]:
    """Write the files every session's /proc view shares into `runtime`: (loadavg, empty)."""
    loadavg, empty = runtime / "loadavg", runtime / "empty"
    loadavg.write_text(LOADAVG)
    empty.write_bytes(b"")
    for path in (loadavg, empty):
        os.chmod(path, 0o444)
    return loadavg, empty


def bwrap_args(meminfo_file: Path, runtime: Path, files, dirs) -> list[str]:
    """bwrap arguments, after `--proc /proc`, that mask and replace (module doc); `runtime` holds
    what `install` wrote."""
    argv = ["--ro-bind", str(meminfo_file), "/proc/meminfo"]
    argv += ["--ro-bind", str(runtime / "loadavg"), "/proc/loadavg"]
    for name in files:  # not /dev/null: a device node on bwrap's nodev /proc cannot be opened
        argv += ["--ro-bind", str(runtime / "empty"), f"/proc/{name}"]
    for name in dirs:
        argv += ["--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
    return argv


def fstab(meminfo_file: Path, runtime: Path, files, dirs) -> str:
    """The same as an fstab for `mount -a --fstab` (one process mounts them all: unshare layer)."""
    rows = [f"{meminfo_file} /proc/meminfo none bind,ro 0 0"]
    rows.append(f"{runtime / 'loadavg'} /proc/loadavg none bind,ro 0 0")
    rows += [f"{runtime / 'empty'} /proc/{name} none bind,ro 0 0" for name in files]
    rows += [f"tmpfs /proc/{name} tmpfs ro,size=4k,nr_inodes=1 0 0" for name in dirs]
    return "\n".join(rows) + "\n"


def hide_other_processes(files, dirs) -> str | None:
    """Fallback layer: mount a new /proc with hidepid=2 over /proc in the service's private mount
    namespace, then the masks on it (an empty file of a private temporary directory over each
    masked file, removed once bound). Returns None when done, else why not (logged). Refuses
    where the kernel would share the host /proc's superblock (before 5.8: the option would reach
    the host's /proc too)."""
    host_dev = os.stat("/proc").st_dev
    scratch = Path(tempfile.mkdtemp(prefix="shellrl-proc-"))
    probe, empty = scratch / "probe", scratch / "empty"
    probe.mkdir()
    empty.write_bytes(b"")
    os.chmod(empty, 0o444)
    flags = mounts.MS_NOSUID | mounts.MS_NODEV | MS_NOEXEC
    try:
        mounts.mount("proc", probe, "proc", flags, "hidepid=2")
        shared = os.stat(probe).st_dev == host_dev
        mounts.umount(probe)
        if shared:
            return "this kernel shares one /proc superblock per pid namespace (before 5.8)"
        mounts.mount("proc", "/proc", "proc", flags, "hidepid=2")
        for name in files:
            mounts.mount(str(empty), f"/proc/{name}", None, mounts.MS_BIND)
        for name in dirs:
            mounts.mount("tmpfs", f"/proc/{name}", "tmpfs", mounts.MS_RDONLY, "size=4k")
    except OSError as exc:
        return f"cannot mount a private /proc: {exc}"
    finally:  # the bind mounts keep the empty file's inode
        shutil.rmtree(scratch, ignore_errors=True)
    return None
