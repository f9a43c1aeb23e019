"""The reaper of one pytest process: kills what that pytest started once pytest is gone, however
it went (SIGKILL, pytest-timeout's os._exit, a crash). Started by tests/helpers/owned_processes.py
as `python -I -S process_reaper.py OWNER`, in a session of its own, so that a signal to pytest's
process group does not reach it; standard library only.

Consumes, on stdin (a pipe whose write end only pytest holds), one line per process group pytest
started: `PGID STARTTIME` (STARTTIME: field 22 of /proc/PGID/stat when it started, in clock ticks).
At end of file (pytest exited: every write end is closed), it
  1. SIGKILLs each such group whose leader still runs or has exited; not one whose pid now names
     another process (then the old group is gone: Linux keeps a pid in use while it is anyone's
     process group id),
  2. SIGKILLs every process whose environment holds TESTS_PROCESS_OWNER=OWNER, pass after pass
     over /proc until one finds no new one: the descendants that left their group (setsid), e.g.
     the services of a `shellrl run` job,
and exits.
"""

from __future__ import annotations

import os
import signal
import sys

OWNER_VARIABLE = "TESTS_PROCESS_OWNER"


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # the fields after "(comm)" start at field 3


def kill_groups(groups: dict[int, str]) -> None:
    for pgid, started in groups.items():
        now = start_time(pgid)
        if now is not None and now != started:
            continue  # the pid was reused: our group is gone
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


def kill_owned(owner: str) -> None:
    """SIGKILL every process whose environment holds OWNER_VARIABLE=owner; again for those that a
    killed one forked while this ran, until a pass over /proc finds no new one."""
    marker, killed = f"{OWNER_VARIABLE}={owner}".encode(), {os.getpid()}
    while True:
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in killed:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker not in f.read().split(b"\0"):
                        continue
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue  # gone, or not ours to read
            killed.add(int(entry))
            found += 1
        if not found:
            return


def main() -> None:
    owner = sys.argv[1]
    groups: dict[int, str] = {}
    for line in sys.stdin.buffer:
        pgid, started = line.split()
        groups[int(pgid)] = started.decode()
    kill_groups(groups)
    kill_owned(owner)


if __name__ == "__main__":
    main()
