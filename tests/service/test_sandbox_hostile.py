"""Issue 32 item 6, the sandbox half: what a command that wants out of a bubblewrap session would
try next, past the issue's bad-input list (test_sandbox_bad_input.py): syscalls around the
seccomp denylist (clone3's flags, the 32-bit and x32 ABIs), the runner's fds and memory, the host
through /proc, processes and sockets of the host and of other sessions, device nodes, links, the
kernel's writable knobs, and a setup whose files grow when the service copies them. Each against
a real sandbox service (bubblewrap) over HTTP; after each, the service is healthy. The proxy
half: test_sandbox_egress_hostile.py; both listed in README.md, Security (sandbox)."""

from __future__ import annotations

import platform
import secrets
import socket
import threading
from pathlib import Path

import httpx
import pytest

from shellrl.clients.sandbox import SandboxClient
from tests.helpers.sandbox_service import processes_of_uid
from tests.helpers.waiting import wait_until

# Each case prints one line per attempt: `<name> <return value> <errno name>`; a case that gets
# through prints something else (a pid, a child's line, an fd).
PROBE = r"""
import ctypes, errno, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(name, nr, *args):
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if ret == 0 and name.startswith("clone"):
        os._exit(0)  # a child made it: it says nothing, the parent prints its pid
    err = errno.errorcode.get(ctypes.get_errno(), "?") if ret < 0 else "-"
    print(name, ret, err, flush=True)
    if ret > 0 and name.startswith("clone"):
        os.waitpid(ret, 0)

class CloneArgs(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("flags", "pidfd", "child_tid", "parent_tid",
                "exit_signal", "stack", "stack_size", "tls", "set_tid", "set_tid_size", "cgroup")]

NEWUSER, NEWNET, NEWNS, SIGCHLD = 0x10000000, 0x40000000, 0x00020000, 17
case = sys.argv[1]
if case == "namespaces":
    call("clone_newuser", 56, NEWUSER | SIGCHLD, 0, 0, 0, 0)
    call("clone_newuser_newnet", 56, NEWUSER | NEWNET | SIGCHLD, 0, 0, 0, 0)
    call("clone_newnet", 56, NEWNET | SIGCHLD, 0, 0, 0, 0)
    call("clone_newns", 56, NEWNS | SIGCHLD, 0, 0, 0, 0)
    args = CloneArgs(flags=NEWUSER, exit_signal=SIGCHLD)  # flags in memory: seccomp cannot see them
    call("clone3_newuser", 435, ctypes.addressof(args), ctypes.sizeof(args))
elif case == "int80":
    code = bytes.fromhex("b814000000cd80c3")  # mov eax, 20 (getpid, i386); int 0x80; ret
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    print("calling", flush=True)
    print("int80", ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))())
elif case == "x32":
    call("x32_mount", 0x40000000 + 165, 0, 0, 0, 0, 0)
    call("x32_unshare", 0x40000000 + 272, NEWUSER)
    call("x32_getpid", 0x40000000 + 39)
elif case == "handles":
    call("name_to_handle_at", 303, -100, 0, 0, 0, 0)
    call("open_by_handle_at", 304, -100, 0, 0)
elif case == "kernel_surface":
    call("keyctl", 250, 0, -3)
    call("add_key", 248, 0, 0, 0, 0, 0)
    call("bpf", 321, 0, 0, 0)
    call("perf_event_open", 298, 0, 0, -1, -1, 0)
    call("userfaultfd", 323, 0)
    call("io_uring_setup", 425, 1, 0)
    call("process_vm_readv", 310, 1, 0, 0, 0, 0, 0)
elif case == "runner":
    call("ptrace_attach_1", 101, 16, 1, 0, 0)
    pidfd = libc.syscall(434, 1, 0)  # pidfd_open works: the runner is visible, pid 1
    for fd in (0, 1, 2, 10, 11, 12, 13):
        call(f"pidfd_getfd_{fd}", 438, pidfd, fd, 0)
elif case == "knobs":
    for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern",
                 "/proc/sys/kernel/modprobe", "/proc/sys/fs/binfmt_misc/register",
                 "/proc/sys/vm/drop_caches", "/sys/kernel/uevent_helper",
                 "/sys/fs/cgroup/release_agent", "/proc/1/oom_score_adj"):
        try:  # opened, never written: a host file must not change if this ever gets through
            os.close(os.open(path, os.O_WRONLY))
            print(path, "OPENED")
        except OSError as exc:
            print(path, errno.errorcode[exc.errno])
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
        print("oom_score_adj", "LOWERED")
    except OSError as exc:
        print("oom_score_adj", errno.errorcode[exc.errno])
"""


@pytest.fixture(scope="module")
def service(sandbox_services):
    return sandbox_services.get("bubblewrap")


@pytest.fixture
async def client(service):
    async with SandboxClient(service.url, timeout_s=30) as c:
        yield c
        # the service survived the test: the client's own 30 s bound, not httpx's default 5 s
        # (a CI beside another, load ~14, timed out connecting at 5 s: httpx.ConnectTimeout)
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as http:
            assert (await http.get("/healthz")).status_code == 200


@pytest.fixture
async def probe(client):
    """A session with PROBE as probe.py; call it with a case name, get its lines."""
    sid = (await client.create_session(setup=f"cat > probe.py <<'EOF'\n{PROBE}\nEOF"))["session_id"]

    async def run(case: str):
        return await client.exec(sid, f"python3 probe.py {case}", timeout_s=20)

    yield run
    await client.delete(sid)


def _lines(result) -> dict[str, str]:
    """{name: "<return> <errno>"} of a probe's output."""
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


async def test_new_namespaces_through_clone_and_clone3_are_refused(probe):
    """seccomp denies unshare and setns, but clone's flags and clone3's (in memory, unseen by a
    seccomp filter) could still ask for a user namespace: bwrap's --disable-userns (a nested
    namespace whose max_user_namespaces is used up) leaves ENOSPC; without one, EPERM."""
    lines = _lines(await probe("namespaces"))
    assert lines == {
        "clone_newuser": "-1 ENOSPC",
        "clone_newuser_newnet": "-1 ENOSPC",
        "clone_newnet": "-1 EPERM",
        "clone_newns": "-1 EPERM",
        "clone3_newuser": "-1 ENOSPC",
    }


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the denylist is x86_64's")
async def test_a_32_bit_syscall_through_int_0x80_kills_the_process(probe):
    """The i386 ABI has other syscall numbers than the x86_64 filter lists: the filter kills a
    process that uses it (SIGSYS) instead of letting it through."""
    result = await probe("int80")
    assert result.stdout == "calling\n" and result.exit_code == 128 + 31, result
    assert "Bad system call" in result.stderr


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the denylist is x86_64's")
async def test_x32_syscall_numbers_are_refused(probe):
    lines = _lines(await probe("x32"))
    assert lines == {"x32_mount": "-1 EPERM", "x32_unshare": "-1 EPERM", "x32_getpid": "-1 EPERM"}


async def test_file_handles_of_the_shocker_escape_are_refused(probe):
    """open_by_handle_at with a guessed handle opened host files from containers (Shocker)."""
    lines = _lines(await probe("handles"))
    assert lines == {"name_to_handle_at": "-1 EPERM", "open_by_handle_at": "-1 EPERM"}


async def test_kernel_exploit_surfaces_are_refused(probe):
    lines = _lines(await probe("kernel_surface"))
    assert set(lines.values()) == {"-1 EPERM"} and len(lines) == 7, lines


async def test_the_runner_cannot_be_traced_nor_its_fds_taken(probe):
    """The runner (pid 1) holds the session's link to the service (fds 10-13): PTRACE_ATTACH and
    pidfd_getfd need ptrace rights over it, and it is non-dumpable."""
    lines = _lines(await probe("runner"))
    assert set(lines.values()) == {"-1 EPERM"} and len(lines) == 8, lines


async def test_the_host_tree_is_not_reachable_through_proc_root_or_cwd(client):
    marker_dir = Path("/var/tmp")
    marker = marker_dir / f"shellrl-hostile-{secrets.token_hex(6)}"
    token = secrets.token_hex(12)
    marker.write_text(token)
    marker.chmod(0o644)  # readable by every uid: only the view stands between
    try:
        sid = (await client.create_session())["session_id"]
        result = await client.exec(
            sid,
            f"for p in {marker} /proc/1/root{marker} /proc/self/root{marker} "
            f"/proc/1/cwd/../..{marker} /proc/*/root{marker}; do cat $p; done; "
            "ls /proc/1/root /proc/1/cwd; head -c 16 /proc/1/mem; cat /proc/1/maps | head -1",
            timeout_s=10,
        )
        assert token not in result.stdout + result.stderr
        denied = [line for line in result.stderr.splitlines() if "Permission denied" in line]
        for path in ("/proc/1/root", "/proc/1/cwd", "/proc/1/mem", "/proc/1/maps"):
            assert any(path in line for line in denied), (path, result.stderr)
        await client.delete(sid)
    finally:
        marker.unlink()


async def test_processes_of_another_session_and_of_the_service_are_out_of_reach(client, service):
    """By host pid: kill -9, PTRACE_ATTACH and pidfd_open of another session's process and of
    the service itself name no process in the session's pid namespace."""
    victim = (await client.create_session())["session_id"]
    await client.exec(victim, "sleep 4321 & echo started")
    uid = (await client.session_info(victim))["uid"]

    def sleeper() -> int | None:
        for pid in processes_of_uid(uid):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x004321\x00":
                    return pid
            except OSError:
                pass
        return None

    host_pid = wait_until(sleeper, timeout_s=5, what="the victim's sleep", poll_s=0.05)
    attacker = (await client.create_session())["session_id"]
    # a pid this small could name one of the session's own few processes (pid namespace)
    pids = [pid for pid in (host_pid, service.proc.pid) if pid > 64]
    attempts = ["true"]
    for pid in pids:
        attempts.append(f"kill -9 {pid}; echo kill=$?")
        attempts.append(
            "python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); "
            f'print("ptrace", l.ptrace(16, {pid}, 0, 0), ctypes.get_errno()); '
            f'print("pidfd", l.syscall(434, {pid}, 0), ctypes.get_errno())\''
        )
    result = await client.exec(attacker, "; ".join(attempts), timeout_s=10)
    assert pids and result.stdout == "kill=1\nptrace -1 3\npidfd -1 3\n" * len(pids), result
    assert result.stderr.count("No such process") == len(pids)  # 3 above: ESRCH
    assert sleeper() == host_pid and service.proc.poll() is None
    for sid in (victim, attacker):
        await client.delete(sid)


async def test_abstract_unix_sockets_of_the_host_and_of_other_sessions_are_unreachable(client):
    """Abstract socket names belong to a network namespace: neither the host's (a listener of
    this test) nor another session's can be connected to; the session's own can."""
    name = f"shellrl-hostile-{secrets.token_hex(4)}"
    host = socket.socket(socket.AF_UNIX)
    host.bind(b"\0host-" + name.encode())
    host.listen(8)
    host.settimeout(0.1)
    accepted, done = [], threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                accepted.append(host.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept)
    thread.start()
    connect = (
        "python3 -c 'import socket, sys\nfor n in sys.argv[1:]:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        '    try:\n        s.connect(b"\\0" + n.encode()); print(n, "connected")\n'
        "    except OSError as e:\n        print(n, e.errno)' "
    )
    try:
        other = (await client.create_session())["session_id"]
        await client.exec(
            other,
            f"python3 -c 'import socket, time; s = socket.socket(socket.AF_UNIX); "
            f's.bind(b"\\0other-{name}"); s.listen(); open("bound", "w"); time.sleep(60)\' &',
        )
        own = await client.exec(  # the listener, seen from its own session once it is bound
            other,
            f"for i in $(seq 200); do [ -e bound ] && break; sleep 0.05; done; {connect} other-{name}",
        )
        assert own.stdout == f"other-{name} connected\n", own
        sid = (await client.create_session())["session_id"]
        result = await client.exec(sid, f"{connect} host-{name} other-{name}")
        assert result.stdout == f"host-{name} 111\nother-{name} 111\n", result  # ECONNREFUSED
        assert accepted == []
        for s in (sid, other):
            await client.delete(s)
    finally:
        done.set()
        thread.join()
        host.close()
        for conn in accepted:
            conn.close()


async def test_device_nodes_and_hard_links_to_host_files_cannot_be_made(client):
    sid = (await client.create_session())["session_id"]
    result = await client.exec(
        sid,
        "mknod sda b 8 0; mknod mem c 1 1; ln /usr/bin/ls ls2; ln /etc/hostname h; ls | wc -l",
    )
    assert result.stdout == "0\n", result
    assert result.stderr.count("Operation not permitted") == 2
    assert result.stderr.count("Invalid cross-device link") == 2
    await client.delete(sid)


async def test_the_kernels_writable_knobs_cannot_be_opened_for_writing(probe):
    """sysrq-trigger, core_pattern, modprobe, binfmt_misc, uevent_helper and a cgroup
    release_agent run host code as root when written (the classic container escapes); a lower
    oom_score_adj would let the OOM killer pick host processes before the session's."""
    lines = _lines(await probe("knobs"))
    assert not any(v in ("OPENED", "LOWERED") for v in lines.values()), lines
    assert set(lines.values()) <= {"EACCES", "ENOENT", "EROFS", "EPERM"}, lines
    assert lines["oom_score_adj"] == "EACCES" and len(lines) == 9


async def test_hard_links_and_sparse_files_of_a_setup_do_not_grow_in_its_copy(client):
    """The service copies the workspace after setup (the snapshot reset returns to) as root into
    a tmpfs of the same size: 200 links to one 4 MiB file and 50 sparse 64 MiB files were
    copied as 800 MiB and 3.2 GiB of data, and creating the session was a 500 (ENOSPC)."""
    setup = (
        "head -c 4M /dev/urandom > a; for i in $(seq 200); do ln a h$i; done; "
        "mkdir d; ln a d/h; for i in $(seq 50); do truncate -s 64M s$i; done; "
        "printf x | dd of=s1 bs=1 seek=1000000 conv=notrunc status=none"
    )
    session = await client.create_session(setup=setup, limits={"workspace_bytes": 64 << 20})
    sid = session["session_id"]
    look = "du -sk .; stat -c %h a; cmp a d/h && echo same; stat -c %s s1; tail -c +1000001 s1 | head -c 1"
    before = await client.exec(sid, look)
    kb, _, links, same, size, byte = before.stdout.split()
    assert int(kb) < 4200 and (links, same, size, byte) == ("202", "same", str(64 << 20), "x")
    await client.exec(sid, "rm -f h*; echo y > a")
    await client.reset(sid)
    after = await client.exec(sid, look)
    assert after.stdout == before.stdout, (before.stdout, after.stdout)
    await client.delete(sid)
