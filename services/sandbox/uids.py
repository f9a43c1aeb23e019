"""The uids of this sandbox instance: one locked uid block, one uid per session, kill by uid."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from pathlib import Path


class UidPool:
    """A block of uids owned by this instance (flock on a lock file) handed out one per session.

    The last uid of the block is reserved for start-up probes. Blocks keep several sandbox
    instances on one machine from sharing uids (and so cgroups and kill sweeps).
    """

    def __init__(self, uid_base: int, block_size: int, max_blocks: int = 256) -> None:
        lock_dir = Path(tempfile.gettempdir()) / "shellrl-sandbox-locks"
        lock_dir.mkdir(mode=0o755, exist_ok=True)
        for block in range(max_blocks):
            fd = os.open(lock_dir / f"uid-block-{uid_base}-{block}.lock",
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
        raise RuntimeError(f"all {max_blocks} sandbox uid blocks from {uid_base} are locked "
                           "by other instances")

    @property
    def uids(self) -> range:
        return range(self.first, self.probe_uid + 1)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, uid: int) -> None:
        self._free.append(uid)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (kill(-1) sent as that uid): catches setsid/double-fork."""
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                    "/usr/bin/kill", "-9", "-1"],
                   env={"PATH": "/usr/bin:/bin"}, cwd="/", stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)
