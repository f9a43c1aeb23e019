"""The diff of a session's workspace against its post-setup snapshot (served by routes.py).

    GET /v1/sessions/{id}/diff   ?max_paths=N → {"session_id", "changed": [{"path", "change"}],
                                                "count", "truncated"}

`change` is `added` (in the workspace, not in the snapshot), `removed` (the reverse) or
`modified` (both, but another file type, mode, owner, size, symlink target or content). Paths are
relative to the workspace root, '/'-separated; a removed or added directory is one entry and its
contents are not listed. Both trees are walked on the host with lstat / O_NOFOLLOW (a symlink is
compared by its target, never followed), so nothing the session planted can send the walk
outside the workspace. Cost: O(files) stat calls plus a byte comparison of the regular files of
equal size (bounded by the workspace's tmpfs size). Read by the verifier's `state_drift` reward
component (services/verifier/reward_components.py).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 1 << 16
DEFAULT_MAX_PATHS = 1000


@dataclass
class WorkspaceDiff:
    """changed: (path, change) pairs in walk order, at most max_paths; count: all of them."""

    changed: list[tuple[str, str]] = field(default_factory=list)
    count: int = 0
    max_paths: int = DEFAULT_MAX_PATHS

    def add(self, path: str, change: str) -> None:
        self.count += 1
        if len(self.changed) < self.max_paths:
            self.changed.append((path, change))

    def as_dict(self) -> dict:
        return {
            "changed": [{"path": p, "change": c} for p, c in self.changed],
            "count": self.count,
            "truncated": self.count > len(self.changed),
        }


def _entries(dir_fd: int) -> dict[str, os.stat_result]:
    return {
        name: os.stat(name, dir_fd=dir_fd, follow_symlinks=False) for name in os.listdir(dir_fd)
    }


def _same_bytes(name: str, base_fd: int, ws_fd: int) -> bool:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    a = os.open(name, flags, dir_fd=base_fd)
    try:
        b = os.open(name, flags, dir_fd=ws_fd)
        try:
            while True:
                x, y = os.read(a, CHUNK), os.read(b, CHUNK)
                if x != y:
                    return False
                if not x:
                    return True
        finally:
            os.close(b)
    finally:
        os.close(a)


def _same(name: str, s: os.stat_result, w: os.stat_result, base_fd: int, ws_fd: int) -> bool:
    if stat.S_IFMT(s.st_mode) != stat.S_IFMT(w.st_mode):
        return False
    if (s.st_mode, s.st_uid, s.st_gid) != (w.st_mode, w.st_uid, w.st_gid):
        return False
    if stat.S_ISLNK(s.st_mode):
        return os.readlink(name, dir_fd=base_fd) == os.readlink(name, dir_fd=ws_fd)
    if stat.S_ISREG(s.st_mode):
        return s.st_size == w.st_size and _same_bytes(name, base_fd, ws_fd)
    return True  # directories (their contents are compared entry by entry), FIFOs, sockets


def _open_dir(name: str, dir_fd: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _walk(prefix: str, base_fd: int, ws_fd: int, out: WorkspaceDiff) -> None:
    base, ws = _entries(base_fd), _entries(ws_fd)
    for name in sorted(base.keys() | ws.keys()):
        path = prefix + name
        s, w = base.get(name), ws.get(name)
        if w is None:
            out.add(path, "removed")
        elif s is None:
            out.add(path, "added")
        elif not _same(name, s, w, base_fd, ws_fd):
            out.add(path, "modified")
        elif stat.S_ISDIR(s.st_mode):
            b, d = _open_dir(name, base_fd), _open_dir(name, ws_fd)
            try:
                _walk(path + "/", b, d, out)
            finally:
                os.close(b)
                os.close(d)


def workspace_diff(base: Path, ws: Path, max_paths: int = DEFAULT_MAX_PATHS) -> WorkspaceDiff:
    """Changes of the tree `ws` against the snapshot `base` (module doc). Raises OSError when a
    tree cannot be read."""
    out = WorkspaceDiff(max_paths=max_paths)
    b, d = _open_dir(str(base), -1), _open_dir(str(ws), -1)
    try:
        _walk("", b, d, out)
    finally:
        os.close(b)
        os.close(d)
    return out
