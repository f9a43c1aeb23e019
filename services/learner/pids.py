"""Whether a process id names a live process: the learner lock (is the holder on this host still
running?) and the shared-memory sweep of weight_transport.py (did the segment's creator exit?)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while a process `pid` exists, also one of another user (signal 0 probes, sends
    nothing: EPERM means it exists). A pid reused by a new process counts as alive; compare start
    times (/proc/<pid>/stat) where that matters."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
