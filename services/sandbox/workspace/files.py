"""Session workspaces on the host: size-capped tmpfs mounts, a snapshot for reset, safe reads.

Layout of one session (`<root>/u<uid>/`, owner root, group = the session uid, mode 0750, so
no other session uid can enter it):

    ctl/          small tmpfs (root's): command, the command being run (per-command mode;
                  read-only to the sandbox), meminfo (the session's /proc/meminfo, bubblewrap)
    base/         tmpfs the setup script writes into (through ws/); read-only afterwards: the
                  snapshot
    ws/           the workspace: a bind of base/ during setup, then its own tmpfs holding a copy
    upper/        tmpfs: tmp/ (the sandbox's /tmp), shm/ (its /dev/shm: bubblewrap, unshare)
    state/        tmpfs of STATE_BYTES, root-owned: the files cwd and env (the shell state
                  carried between commands), the only ones the session can write there

Each tmpfs of the session's files has `size=workspace_bytes`, so writes stop with ENOSPC at the
cap (RLIMIT_FSIZE alone is per file); a full /tmp or /dev/shm cannot cost the shell state its
room. Every file the sandbox sees is on one of these tmpfs mounts and they are mounted without
`uid=` (chowned after): its mountinfo names no host path and no session. Reset, with no process
of the session alive, wipes ws/, tmp/, shm/ and state/ in place (the long-lived sandbox keeps its
bind of the same mounts) and copies base/ back (`copy_tree`: ownership, modes, times, symlinks,
FIFOs, hard links and holes kept, so the copy fits where base/ did; nothing followed):
O(workspace size), a few ms for 100 small files. Host-side reads go through `read_file`, which
resolves the path beneath the workspace with openat2(RESOLVE_BENEATH), so planted symlinks
cannot escape.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.host import mounts

INODES_PER_MIB = 256  # nr_inodes of a tmpfs per MiB of its size (100 small files need ~100)
STATE_BYTES = (
    4 << 20
)  # the state tmpfs: `export -p` of a usable environment (execve caps it at ~2 MiB)
STATE_FILES = ("cwd", "env", "trace")  # trace: the executed-argv trace (isolation/argv_trace.py)


class FileReadError(Exception):
    """Reading a workspace file failed; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class WorkspacePaths:
    session_dir: Path

    @property
    def ctl(self) -> Path:
        return self.session_dir / "ctl"

    @property
    def command_file(self) -> Path:
        return self.ctl / "command"

    @property
    def base(self) -> Path:
        return self.session_dir / "base"

    @property
    def upper(self) -> Path:
        return self.session_dir / "upper"

    @property
    def ws(self) -> Path:
        return self.session_dir / "ws"

    @property
    def tmp(self) -> Path:
        return self.upper / "tmp"

    @property
    def shm(self) -> Path:
        return self.upper / "shm"

    @property
    def state(self) -> Path:
        return self.session_dir / "state"


class Workspace:
    """The mounts of one session. All methods are synchronous and fast (a few mount syscalls)."""

    def __init__(self, session_dir: Path, uid: int, size_bytes: int) -> None:
        self.paths = WorkspacePaths(Path(session_dir))
        self.uid = uid
        self.size_bytes = size_bytes
        self.nr_inodes = max(1024, size_bytes // (1 << 20) * INODES_PER_MIB)
        self.snapshotted = False

    def _tmpfs(self, target: Path, owner_uid: int) -> None:
        mounts.mount(
            "tmpfs",
            target,
            "tmpfs",
            mounts.MS_NOSUID | mounts.MS_NODEV,
            f"size={self.size_bytes},nr_inodes={self.nr_inodes},mode=0755",
        )
        os.chown(target, owner_uid, owner_uid)

    def _fresh_upper(self) -> None:
        p = self.paths
        self._tmpfs(p.upper, 0)
        for d in (p.tmp, p.shm):
            d.mkdir(mode=0o700)
            os.chown(d, self.uid, self.uid)

    def _fresh_state(self) -> None:
        mounts.mount(
            "tmpfs",
            self.paths.state,
            "tmpfs",
            mounts.MS_NOSUID | mounts.MS_NODEV,
            f"size={STATE_BYTES},nr_inodes=16,mode=0755,uid=0,gid=0",
        )
        self._empty_state_files()

    def _empty_state_files(self) -> None:
        for name in STATE_FILES:
            fd = os.open(
                self.paths.state / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
            )
            os.fchown(fd, self.uid, self.uid)
            os.close(fd)

    def create(self) -> None:
        """Empty workspace, ready for the setup script (ws/ is base/ until `snapshot`); what an
        earlier session of the same uid left (a failed clean-up) is removed first."""
        p = self.paths
        if p.session_dir.exists():
            self.destroy()
        p.session_dir.mkdir(mode=0o750)
        os.chown(p.session_dir, 0, self.uid)
        for d in (p.ctl, p.base, p.upper, p.ws, p.state):
            d.mkdir(mode=0o755)
        mounts.mount(
            "tmpfs", p.ctl, "tmpfs", mounts.MS_NOSUID | mounts.MS_NODEV, "nr_inodes=16,mode=0755"
        )
        p.command_file.write_bytes(b"")
        os.chmod(p.command_file, 0o644)
        self._tmpfs(p.base, self.uid)
        mounts.mount(str(p.base), p.ws, None, mounts.MS_BIND)
        self._fresh_upper()
        self._fresh_state()

    def snapshot(self) -> None:
        """Freeze the state after setup (no session process alive): base/ becomes read-only,
        the workspace becomes its own tmpfs with a copy of it, /tmp, /dev/shm and the shell state
        start empty."""
        p = self.paths
        mounts.umount(p.ws)
        mounts.mount(
            None,
            p.base,
            None,
            mounts.MS_REMOUNT | mounts.MS_RDONLY | mounts.MS_NOSUID | mounts.MS_NODEV,
            f"size={self.size_bytes},nr_inodes={self.nr_inodes}",
        )
        mounts.umount(p.upper)
        self._fresh_upper()
        mounts.umount(p.state)
        self._fresh_state()
        self._tmpfs(p.ws, self.uid)
        copy_tree(p.base, p.ws)
        self.snapshotted = True

    def reset(self) -> None:
        """Back to the state right after setup; the caller guarantees no session process is alive."""
        p = self.paths
        for directory in (p.ws, p.tmp, p.shm, p.state):
            empty_dir(directory)
        self._empty_state_files()
        copy_tree(p.base, p.ws)

    def destroy(self) -> None:
        """Unmount everything and delete the session directory."""
        for point in mounts.mounted_below(self.paths.session_dir):
            mounts.umount(point)
        shutil.rmtree(self.paths.session_dir, ignore_errors=True)

    def read_file(self, relative_path: str, max_bytes: int) -> bytes:
        """The bytes of a regular file beneath the workspace.

        Raises FileReadError: 400 (not a regular file / bad path), 403 (the path or a symlink on it
        leaves the workspace), 404 (missing), 413 (larger than `max_bytes`).
        """
        if "\x00" in relative_path or not relative_path.strip("/"):
            raise FileReadError(400, "invalid_path", "path must name a file inside the workspace")
        fd = open_beneath(self.paths.ws, relative_path.lstrip("/"))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FileReadError(400, "not_a_file", f"{relative_path!r} is not a regular file")
            if info.st_size > max_bytes:
                raise FileReadError(
                    413,
                    "file_too_large",
                    f"{relative_path!r} has {info.st_size} bytes, more than max_bytes={max_bytes}",
                )
            chunks, total = [], 0
            while chunk := os.read(fd, 1 << 20):
                total += len(chunk)
                if total > max_bytes:
                    raise FileReadError(
                        413, "file_too_large", f"{relative_path!r} grew past max_bytes={max_bytes}"
                    )
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


def empty_dir(path: Path) -> None:
    """Delete everything inside `path` (not `path` itself), never following symlinks."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def copy_tree(src: Path, dst: Path) -> None:
    """Copy the contents of `src` into the existing directory `dst` like `cp -a` (owner, mode,
    times, symlinks as links, FIFOs as FIFOs, hard links as links, holes as holes; sockets and
    device nodes skipped), through directory file descriptors so that no symlink is ever
    followed. The copy takes no more room than `src`: a setup that made 200 links to one 4 MiB
    file, or 50 sparse 64 MiB files, overflowed a copy into a tmpfs of the same size."""
    src_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    dst_fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _copy_dir(src_fd, dst_fd, _Links(dst_fd), "")
        _copy_meta(os.fstat(src_fd), dst_fd)
    finally:
        os.close(src_fd)
        os.close(dst_fd)


class _Links:
    """Where in the copy each multiply linked file of `src` went first (paths relative to the
    copy's root, made by this copy: directories all the way, nothing to follow)."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd, self.first = root_fd, {}

    def link(self, st: os.stat_result, name: str, dst_fd: int, path: str) -> bool:
        """Link `name` in `dst_fd` to the copy of the same inode if there is one; else note
        `path` as that copy (False: the caller copies the file)."""
        if st.st_nlink < 2:
            return False
        first = self.first.setdefault((st.st_dev, st.st_ino), path)
        if first == path:
            return False
        os.link(first, name, src_dir_fd=self.root_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
        return True


def _copy_meta(st: os.stat_result, fd: int) -> None:
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_data(src: int, dst: int, size: int) -> None:
    """The data extents of `src` to the same offsets of `dst` (holes stay holes), then its size."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole up to the end
                break
            raise
        end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        os.lseek(dst, start, os.SEEK_SET)
        while start < end:
            sent = os.sendfile(dst, src, start, end - start)
            if sent == 0:
                break
            start += sent
        offset = max(end, start)
    os.ftruncate(dst, size)


def _copy_dir(src_fd: int, dst_fd: int, links: _Links, prefix: str) -> None:
    for name in os.listdir(src_fd):
        st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(name, 0o700, dir_fd=dst_fd)
            s = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd
            )
            d = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dst_fd
            )
            try:
                _copy_dir(s, d, links, f"{prefix}{name}/")
                _copy_meta(st, d)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISREG(mode):
            if links.link(st, name, dst_fd, prefix + name):
                continue
            s = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
            d = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dst_fd,
            )
            try:
                _copy_data(s, d, st.st_size)
                _copy_meta(st, d)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
            os.chown(name, st.st_uid, st.st_gid, dir_fd=dst_fd, follow_symlinks=False)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(name, stat.S_IMODE(mode), dir_fd=dst_fd)
            os.chown(name, st.st_uid, st.st_gid, dir_fd=dst_fd, follow_symlinks=False)


# openat2(2): resolve a path beneath a directory fd, following symlinks only while they stay inside.
_SYS_OPENAT2 = 437
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x01, 0x02, 0x08
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(root: Path, relative_path: str) -> int:
    """fd of `relative_path` opened read-only beneath `root`; FileReadError 403/404 otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV)
        fd = _libc.syscall(
            _SYS_OPENAT2, root_fd, os.fsencode(relative_path), ctypes.byref(how), ctypes.sizeof(how)
        )
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            return _open_no_symlinks(root_fd, relative_path, flags)
        raise _read_error(err, relative_path)
    finally:
        os.close(root_fd)


def _open_no_symlinks(root_fd: int, relative_path: str, flags: int) -> int:
    """Kernels without openat2: walk component by component with O_NOFOLLOW (no symlinks at all)."""
    parts = [p for p in relative_path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileReadError(
            403, "path_outside_workspace", f"{relative_path!r} leaves the workspace"
        )
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(
                    part, (flags if last else os.O_PATH | os.O_DIRECTORY) | os.O_NOFOLLOW, dir_fd=fd
                )
            except OSError as exc:
                raise _read_error(exc.errno, relative_path) from None
            os.close(fd)
            fd = nxt
        return os.dup(fd)
    finally:
        os.close(fd)


def _read_error(err: int, path: str) -> FileReadError:
    if err == errno.ENOENT:
        return FileReadError(404, "file_not_found", f"{path!r} does not exist in the workspace")
    if err in (errno.EXDEV, errno.ELOOP):
        return FileReadError(
            403, "path_outside_workspace", f"{path!r} (or a symlink on it) leaves the workspace"
        )
    if err == errno.ENOTDIR:
        return FileReadError(404, "file_not_found", f"{path!r}: a parent is not a directory")
    if err == errno.EISDIR:
        return FileReadError(400, "not_a_file", f"{path!r} is a directory")
    return FileReadError(400, "invalid_path", f"{path!r}: {os.strerror(err)}")
