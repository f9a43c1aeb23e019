"""The control-plane benchmark's stack checks that each port it chose is listened on by the process
it was chosen for (benchmarks/control_plane_stack.py `_listens`): a ready answer from a port
another process bound between choice and bind ended two `make bench` runs (issue 37)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from benchmarks.control_plane_stack import _listens
from tests.helpers.owned_processes import popen_owned, stop_owned

LISTENER = (
    "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
    " print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


def test_a_port_counts_as_owned_only_by_the_process_listening_on_it():
    own = socket.socket()
    own.bind(("127.0.0.1", 0))
    own.listen()
    bound_only = socket.socket()
    bound_only.bind(("127.0.0.1", 0))
    child = popen_owned(
        [sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        foreign = int(child.stdout.readline())
        assert _listens(os.getpid(), own.getsockname()[1])
        assert not _listens(child.pid, own.getsockname()[1])
        assert _listens(child.pid, foreign) and not _listens(os.getpid(), foreign)
        assert not _listens(os.getpid(), bound_only.getsockname()[1])  # bound, not listening
    finally:
        own.close()
        bound_only.close()
        stop_owned(child)
