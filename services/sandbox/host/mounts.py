"""Thin wrappers over mount(2)/umount2(2)/unshare(2) through libc (no `mount` process per call)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
CLONE_NEWNS = 0x00020000

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)


def _enc(value: str | os.PathLike | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def mount(
    source: str | None,
    target: str | os.PathLike,
    fstype: str | None,
    flags: int = 0,
    data: str | None = None,
) -> None:
    """mount(2); raises OSError with the errno and the target."""
    if _libc.mount(_enc(source), _enc(target), _enc(fstype), flags, _enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or 'bind'} on {target}: {os.strerror(err)}")


def umount(target: str | os.PathLike, lazy_fallback: bool = True) -> None:
    """umount2(2); falls back to a lazy detach when busy. Missing mounts are ignored."""
    if _libc.umount2(_enc(target), 0) == 0:
        return
    err = ctypes.get_errno()
    if err in (22, 2):  # EINVAL: not a mount point; ENOENT
        return
    if lazy_fallback and _libc.umount2(_enc(target), MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    raise OSError(err, f"umount {target}: {os.strerror(err)}")


def private_mount_namespace() -> bool:
    """Move this (single-threaded) process into its own mount namespace so that the session
    mounts vanish with it, even after a crash. Returns False where that is not permitted."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        return False
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
    except OSError:
        return False
    return True


def mounted_below(root: str | os.PathLike) -> list[str]:
    """Mount points at or below `root`, deepest first (for clean-up)."""
    root = os.path.realpath(root)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == root or point.startswith(root + "/"):
                points.append(point)
    return sorted(points, key=len, reverse=True)
