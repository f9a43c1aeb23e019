"""The uids of this sandbox instance: one locked uid block, one uid per session; what a uid
leaves where every uid can: its processes (kill by uid), files in world-writable host directories,
SysV IPC objects."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class UidPool:
    """A block of uids owned by this instance (flock on a lock file) handed out one per session.

    The last uid of the block is reserved for start-up probes. Blocks keep several sandbox
    instances on one machine from sharing uids (and so cgroups and kill sweeps).
    """

    def __init__(self, uid_base: int, block_size: int, max_blocks: int = 256) -> None:
        lock_dir = Path(tempfile.gettempdir()) / "shellrl-sandbox-locks"
        lock_dir.mkdir(mode=0o755, exist_ok=True)
        for block in range(max_blocks):
            fd = os.open(
                lock_dir / f"uid-block-{uid_base}-{block}.lock",
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                0o600,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd, self.block = fd, block
            self.first = uid_base + block * block_size
            self.probe_uid = self.first + block_size - 1
            self._free = list(range(self.first + block_size - 2, self.first - 1, -1))
            return
        raise RuntimeError(
            f"all {max_blocks} sandbox uid blocks from {uid_base} are locked by other instances"
        )

    @property
    def uids(self) -> range:
        return range(self.first, self.probe_uid + 1)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, uid: int) -> None:
        self._free.append(uid)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (kill(-1) sent as that uid): catches setsid/double-fork."""
    subprocess.run(
        [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--",
            "/usr/bin/kill",
            "-9",
            "-1",
        ],
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=10,
        check=False,
    )


def live_processes_of(uids: Collection[int]) -> dict[int, list[int]]:
    """{uid: pids} of the live (not zombie) processes whose real or saved uid is one of `uids`
    (those a `kill_uid` of that uid reaches), read from /proc/<pid>/status."""
    found: dict[int, list[int]] = {}
    wanted = set(uids)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = dict(
                line.split(":", 1)
                for line in Path(f"/proc/{entry}/status").read_text().splitlines()
            )
        except (OSError, ValueError):
            continue  # gone meanwhile
        dead = fields.get("State", "").split()[:1] in (["Z"], ["X"])
        if dead and fields.get("Threads", "").strip() in ("", "1"):
            continue  # a zombie; one whose main thread exited while others run is alive
        real, _effective, saved, _fs = (int(u) for u in fields["Uid"].split())
        for uid in {real, saved} & wanted:
            found.setdefault(uid, []).append(int(entry))
    return found


def kill_uids_until_none(uids: Collection[int], deadline_s: float = 10.0) -> list[int]:
    """SIGKILL every process of `uids` (`kill_uid` for each uid that has one) and look again,
    every 50 ms, until a scan finds none, for `deadline_s` at most (then an error is logged).
    Returns the pids seen.

    A restarted instance's sweep of its uid block (known_pitfalls D06, bubblewrap#633): a sandbox
    whose service was SIGKILLed before bwrap armed its death signal runs on as an orphan, outside
    any session cgroup while bwrap sets up (cgroup v1: only the command joins them)."""
    seen: set[int] = set()
    deadline = time.monotonic() + deadline_s
    while found := live_processes_of(uids):
        seen.update(pid for pids in found.values() for pid in pids)
        if time.monotonic() > deadline:
            log.error("processes survived the uid sweep", extra={"pids": found})
            break
        for uid in found:
            kill_uid(uid)
        time.sleep(0.05)
    return sorted(seen)


IPC_RMID = 0
_libc = ctypes.CDLL(None, use_errno=True)
# /proc/sysvipc/<kind>: the id column and how to remove one object of that kind
_IPC_KINDS = {
    "shm": ("shmid", lambda i: _libc.shmctl(i, IPC_RMID, None)),
    "msg": ("msqid", lambda i: _libc.msgctl(i, IPC_RMID, None)),
    "sem": ("semid", lambda i: _libc.semctl(i, 0, IPC_RMID)),
}


def remove_ipc_objects(uids) -> int:
    """Remove the SysV shared memory segments, message queues and semaphore sets of this IPC
    namespace owned by one of `uids` (a layer without its own IPC namespace keeps them on the
    host after the session's processes die); returns how many."""
    removed = 0
    for kind, (id_column, remove) in _IPC_KINDS.items():
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        header = lines[0].split() if lines else []
        for line in lines[1:]:
            row = dict(zip(header, line.split()))
            if int(row.get("uid", -1)) in uids and remove(int(row[id_column])) == 0:
                removed += 1
    return removed


def remove_owned(directories: Iterable[str], uids: Collection[int]) -> int:
    """Delete the entries directly inside `directories` (host directories every uid may write,
    such as /tmp) that belong to one of `uids`, recursively and without following symlinks;
    returns how many. Missing directories are skipped."""
    removed = 0
    for directory in directories:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid not in uids:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                continue
    return removed
