"""Session runner: the long-lived process inside one session's sandbox (pid 1 of its pid namespace
under bubblewrap and unshare). It runs with the system `python3 -I -S` and the standard library's
builtin modules only; it never imports shellrl.

Protocol on stdin/stdout (binary, one request at a time):

    request:  b"EXEC <timeout_ms> <max_output_bytes> <command_len> <fresh_state 0|1>\\n"
              + command bytes
    response: b"DONE <exit_code> <timed_out 0|1> <stdout_total> <stderr_total> <duration_us>"
              b" <len stdout_head> <len stdout_tail> <len stderr_head> <len stderr_tail>\\n" + the four byte strings

Each command is `bash -c <prelude>` spawned with posix_spawn in a new session, stdin /dev/null,
the command text on fd 3 (a memfd, so 1 MB commands work), signal dispositions reset. The exec
is done when bash exits (not when the pipes close); pipes still held by background processes are
then drained and discarded in the background so those processes never block or get EPIPE.
On timeout the runner sends SIGKILL to -1: as pid 1 of the namespace (or as the session's own uid
in the fallback layer) that kills every process of the session except the runner.
fresh_state 1: `bash --noprofile --norc -c <fresh prelude>` in the runner's own environment (the
session's, fixed at its start) without BASH_ENV, ENV and BASH_FUNC_*; nothing the session wrote
is read.
Request b"KILL\n" (answered b"KILLED\n"): every process of the session but the runner is killed;
b"RESET\n" (answered b"KILLED\n") also removes every SysV IPC object (shared memory, message
queue, semaphore set) of the runner's uid in its IPC namespace (the session's own under bubblewrap
and unshare).
Start-up: the runner writes b"READY\n", then reads b"INIT <len> <fresh_len>\n" + the bash prelude
every command runs first (it joins the session cgroup, sets rlimits, restores cwd/env: see
isolation/layers.py) + the fresh-state prelude.
The session's cgroups: argv[1], when given, lists fds (comma-separated) of their `cgroup.procs`
files, opened for writing by the service (root). No cgroup file is in the sandbox's file tree and
none is writable by the session uid: each command gets the fds at CGROUP_FD_FIRST, CGROUP_FD_FIRST
+ 1 ... (its prelude writes its pid there, then closes them); the runner keeps its copies
close-on-exec, and commands cannot take them (PR_SET_DUMPABLE 0: no ptrace, no /proc/1/fd).
"""

import _signal
import os
import select
import sys
import time

CHUNK = 1 << 16
DRAIN_GRACE_S = 0.02
MAX_BACKGROUND_PIPES = 64
SIGKILL = 9
TIMEOUT_EXIT_CODE = 124  # like timeout(1)
RESET_SIGNALS = [s for s in range(1, 65) if s not in (9, 19, 32, 33)]
FRESH_ENV_DROPPED = ("BASH_ENV", "ENV")  # as services/sandbox/isolation/preludes.py fresh_env
CGROUP_FD_FIRST = (
    4  # as services/sandbox/isolation/preludes.py RUNNER_CGROUP_FD_FIRST (fd 3: the command)
)
KEPT_FD_FIRST = 100  # where the runner keeps its own copies (never a target of a command's dup2)


class Capture:
    """First `cap - cap // 2` and last `cap // 2` bytes of a stream, plus its total size (the
    service's executor.OutputBuffer extends it)."""

    def __init__(self, cap):
        self.head_cap, self.tail_cap = cap - cap // 2, cap // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def feed(self, data):
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def parts(self):
        return bytes(self.head), bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b""


class Runner:
    def __init__(self, prelude, fresh_prelude="", cgroup_fds=()):
        self.prelude, self.fresh_prelude = prelude, fresh_prelude
        self.cgroup_fds = keep_fds(cgroup_fds)
        self.env = dict(os.environ)
        self.fresh_env = {
            k: v
            for k, v in self.env.items()
            if k not in FRESH_ENV_DROPPED and not k.startswith("BASH_FUNC_")
        }
        self.devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self.background = []  # read ends still held open by background processes
        self.statuses = {}
        self.inbuf = bytearray()

    # ---- plumbing ------------------------------------------------------------------------
    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.statuses[pid] = status

    def drain_background(self, ready):
        for fd in list(self.background):
            if fd in ready:
                try:
                    data = os.read(fd, CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    os.close(fd)
                    self.background.remove(fd)

    def fill(self):
        """Wait for request bytes (draining background pipes and reaping meanwhile)."""
        while True:
            poller = select.poll()
            poller.register(0, select.POLLIN)
            for fd in self.background:
                poller.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll(1000)}
            self.reap()
            self.drain_background(ready)
            if 0 in ready:
                data = os.read(0, CHUNK)
                if not data:
                    raise EOFError
                self.inbuf += data
                return

    def read_exact(self, n):
        while len(self.inbuf) < n:
            self.fill()
        out = bytes(self.inbuf[:n])
        del self.inbuf[:n]
        return out

    def read_line(self):
        while b"\n" not in self.inbuf:
            self.fill()
        i = self.inbuf.index(b"\n")
        line = bytes(self.inbuf[:i])
        del self.inbuf[: i + 1]
        return line

    def kill_all(self):
        """SIGKILL -1 (all but this runner), reap, forget the background pipes."""
        try:
            os.kill(-1, SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.001)
        self.statuses.clear()
        for fd in self.background:
            os.close(fd)
        self.background.clear()

    def remove_ipc(self):
        """IPC_RMID every SysV IPC object this uid owns in this IPC namespace (/proc/sysvipc)."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        uid = os.getuid()
        for kind, id_column, remove in (
            ("shm", "shmid", lambda i: libc.shmctl(i, 0, None)),
            ("msg", "msqid", lambda i: libc.msgctl(i, 0, None)),
            ("sem", "semid", lambda i: libc.semctl(i, 0, 0)),
        ):
            try:
                with open(f"/proc/sysvipc/{kind}") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            header = lines[0].split() if lines else []
            for line in lines[1:]:
                row = dict(zip(header, line.split()))
                if row.get("uid") == str(uid):
                    remove(int(row[id_column]))

    # ---- one command ---------------------------------------------------------------------
    def run(self, command, timeout_s, cap, fresh_state=False):
        start = time.monotonic()
        if fresh_state:
            argv, env = (
                ["bash", "--noprofile", "--norc", "-c", self.fresh_prelude, "bash"],
                self.fresh_env,
            )
        else:
            argv, env = ["bash", "-c", self.prelude, "bash"], self.env
        memfd = os.memfd_create("shellrl-command")
        view = memoryview(command)
        while view:
            view = view[os.write(memfd, view) :]
        os.lseek(memfd, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = os.posix_spawn(
                "/usr/bin/bash",
                argv,
                env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, self.devnull, 0),
                    (os.POSIX_SPAWN_DUP2, out_w, 1),
                    (os.POSIX_SPAWN_DUP2, err_w, 2),
                    (os.POSIX_SPAWN_DUP2, memfd, 3),
                    *[
                        (os.POSIX_SPAWN_DUP2, fd, CGROUP_FD_FIRST + i)
                        for i, fd in enumerate(self.cgroup_fds)
                    ],
                ],
                setsid=True,
                setsigdef=RESET_SIGNALS,
            )
        finally:
            for fd in (out_w, err_w, memfd):
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        captures = {out_r: Capture(cap), err_r: Capture(cap)}
        open_fds = {out_r, err_r}
        deadline = start + timeout_s
        timed_out = False
        exited = False
        drain_until = None
        while True:
            now = time.monotonic()
            if not exited and now >= deadline:
                timed_out = True
                os.kill(-1, SIGKILL)  # every process of the session but this runner
                deadline = float("inf")
                drain_until = now + 2.0
            if exited and (not open_fds or now >= drain_until):
                break
            poller = select.poll()
            for fd in open_fds | set(self.background):
                poller.register(fd, select.POLLIN)
            if not exited:
                poller.register(pidfd, select.POLLIN)
            wait_s = max(0.0, (drain_until if exited else deadline) - now)
            ready = {fd for fd, _ in poller.poll(min(wait_s, 3600.0) * 1000.0)}
            for fd in open_fds & ready:  # a new set: the loop discards closed fds from open_fds
                try:
                    data = os.read(fd, CHUNK)
                except BlockingIOError:
                    continue
                if data:
                    captures[fd].feed(data)
                else:
                    os.close(fd)
                    open_fds.discard(fd)
            self.drain_background(ready)
            if not exited and pidfd in ready:
                exited = True
                if drain_until is None:
                    drain_until = time.monotonic() + DRAIN_GRACE_S
        os.close(pidfd)
        status = self.statuses.pop(pid, None)
        if status is None:
            _, status = os.waitpid(pid, 0)
        self.reap()
        for fd in open_fds:  # still held by background processes: keep draining, discard
            self.background.append(fd)
        while len(self.background) > MAX_BACKGROUND_PIPES:
            os.close(self.background.pop(0))
        self.statuses.clear()
        code = os.waitstatus_to_exitcode(status)
        exit_code = TIMEOUT_EXIT_CODE if timed_out else (128 - code if code < 0 else code)
        duration_us = int((time.monotonic() - start) * 1e6)
        return exit_code, timed_out, captures[out_r], captures[err_r], duration_us

    def serve(self):
        while True:
            try:
                header = self.read_line().split()
            except EOFError:
                return
            if header in ([b"KILL"], [b"RESET"]):
                self.kill_all()
                if header == [b"RESET"]:
                    self.remove_ipc()
                os.write(1, b"KILLED\n")
                continue
            if not header or header[0] != b"EXEC" or len(header) != 5:
                sys.stderr.write(f"runner: bad request header {header!r}\n")
                return
            timeout_ms, cap, length, fresh_state = (int(x) for x in header[1:])
            command = self.read_exact(length)
            exit_code, timed_out, out, err, duration_us = self.run(
                command, timeout_ms / 1000.0, cap, bool(fresh_state)
            )
            oh, ot = out.parts()
            eh, et = err.parts()
            head = (
                f"DONE {exit_code} {int(timed_out)} {out.total} {err.total} {duration_us}"
                f" {len(oh)} {len(ot)} {len(eh)} {len(et)}\n"
            ).encode()
            payload = memoryview(head + oh + ot + eh + et)
            while payload:
                payload = payload[os.write(1, payload) :]


def keep_fds(fds):
    """The inherited fds moved to KEPT_FD_FIRST, KEPT_FD_FIRST + 1 ..., close-on-exec."""
    kept = []
    for i, fd in enumerate(fds):
        kept.append(os.dup2(fd, KEPT_FD_FIRST + i, inheritable=False))
        os.close(fd)
    return kept


def harden():
    """PR_SET_DUMPABLE 0: commands (same uid) cannot ptrace or read /proc of the runner.
    Outside a pid namespace (fallback layer) also PR_SET_PDEATHSIG: die with the service."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    if os.getpid() != 1:
        parent = os.getppid()
        if libc.prctl(1, SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent or parent == 1:
            sys.exit("runner: the service is gone")


def main():
    harden()
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    os.write(1, b"READY\n")
    cgroup_fds = [int(fd) for fd in sys.argv[1].split(",")] if len(sys.argv) > 1 else []
    runner = Runner("", cgroup_fds=cgroup_fds)
    header = runner.read_line().split()
    if len(header) != 3 or header[0] != b"INIT":
        sys.stderr.write(f"runner: expected INIT, got {header!r}\n")
        return
    runner.prelude = runner.read_exact(int(header[1])).decode()
    runner.fresh_prelude = runner.read_exact(int(header[2])).decode()
    runner.serve()


if __name__ == "__main__":
    main()
