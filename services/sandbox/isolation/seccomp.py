"""A seccomp-BPF denylist for bubblewrap sandboxes (`bwrap --seccomp FD`), built without libseccomp.

Denied with EPERM: syscalls that only widen the kernel attack surface for a shell task, or that
need privileges a session never has: mounting and mount-API calls, pivot_root, module loading,
kexec, reboot, swap, keyrings, bpf, perf_event_open, userfaultfd, io_uring, process_vm_readv/
writev, open_by_handle_at, unshare/setns, acct, quotactl, syslog, iopl/ioperm, lookup_dcookie,
vhangup. Everything else is allowed (ptrace too: debuggers work inside the pid namespace, and the
runner is non-dumpable). A foreign architecture (32-bit syscalls on x86_64) kills the process;
x32-ABI numbers are refused. Only x86_64 is described here; elsewhere the service runs without
the filter and says so (`/readyz` "seccomp": false).

Program layout (classic BPF over `struct seccomp_data`; Linux Documentation/userspace-api/seccomp_filter.rst):
    ld arch; jeq AUDIT_ARCH_X86_64 ? +1 : kill; ld nr; jge 0x40000000 ? errno;
    jeq nr_i ? errno  (for every denied nr); ret allow; ret errno(EPERM)
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06

DENIED_X86_64 = {
    "syslog": 103,
    "vhangup": 153,
    "pivot_root": 155,
    "acct": 163,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def denylist_program() -> bytes | None:
    """The filter as bytes for `bwrap --seccomp`, or None on an architecture not described here."""
    if platform.machine() != "x86_64":
        return None
    numbers = sorted(DENIED_X86_64.values())
    n = len(numbers)
    prog = [
        _insn(LD_W_ABS, 0, 0, 4),
        _insn(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        _insn(RET_K, 0, 0, RET_KILL_PROCESS),
        _insn(LD_W_ABS, 0, 0, 0),
        _insn(JGE_K, n + 1, 0, X32_SYSCALL_BIT),
    ]
    for i, nr in enumerate(numbers):  # jump to the errno return, which sits after `ret allow`
        prog.append(_insn(JEQ_K, n - i, 0, nr))
    prog += [_insn(RET_K, 0, 0, RET_ALLOW), _insn(RET_K, 0, 0, RET_ERRNO | errno.EPERM)]
    return b"".join(prog)
