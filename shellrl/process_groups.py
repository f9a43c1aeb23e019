"""Leaving a torch process group cleanly, and ending a process that was a rank of one: the one
place that destroys process groups (the learner's ranks, the weight-update groups between a
learner and its engines, the tests' two-rank helpers).

Why a helper: "terminate called without an active exception" (SIGABRT, exit -6) at the end of a
rank's process that passed. gloo runs each collective on a worker thread of the process group;
that thread drops the collective's tensors after the waiting thread was told the work is done.
A tensor that has a Python object needs the GIL to be freed; when the main thread has already
returned and the interpreter is finalizing, taking the GIL ends the worker thread with
pthread_exit, whose forced unwind through a noexcept frame calls std::terminate (pytorch PR
179291, issue 190489). `destroy_process_group` alone does not prevent it: the group's C++ object
(and its worker threads) lives on while any Python object refers to it, and it is freed during
that same finalization. Reproduced here (tests/helpers/two_rank_exit.py: two gloo ranks under
torchrun, 20 `scatter_object_list` calls, then the end of the process; 2 cores with other tests
running): the old `Ranks.close` (destroy_process_group, the group still referenced) aborted 8
runs in 60; `leave` + `exit_process` 0 in 60 (tests/service/test_process_groups.py runs it 20
times beside CPU burners).

The rule: a rank leaves with `leave(together=True)` once every rank knows the run is over (a
barrier, so no peer is inside a collective when the sockets close), and a process that was a
rank ends with `exit_process`, which flushes logs and output and skips interpreter finalization
(`os._exit`), so no worker thread can meet a finalizing interpreter. Long-lived processes that
drop one group and go on (an engine's weight-update group) use `leave(group)`: the group is
destroyed and collected while the interpreter is fully alive.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any, NoReturn

log = logging.getLogger(__name__)


def leave(group: Any = None, *, together: bool = False) -> None:
    """Leave `group` (None: every group of this process, the default one included).

    together: first wait at a barrier of the group for every other rank (only when all of them
    call `leave` at this point: a barrier against a peer inside another collective would pair
    with it); a barrier that fails (a peer is gone, torch's timeout of the group) is logged and
    the group destroyed anyway. Then the group is destroyed (errors of a broken group ignored)
    and garbage is collected, so a group no longer referenced is freed here, its worker threads
    joined, while the interpreter is alive. Never raises; a no-op when torch.distributed has no
    group."""
    import torch.distributed as dist

    if not dist.is_available() or (group is None and not dist.is_initialized()):
        return
    if together:
        try:
            dist.barrier(group=group)
        except Exception as exc:  # noqa: BLE001 (a peer that is gone: leave anyway)
            log.warning("leaving a process group without its peers", extra={"error": str(exc)})
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 (a broken group still has to go)
        pass
    gc.collect()


def exit_process(code: int = 0) -> NoReturn:
    """End this process now with `code`: logging handlers and stdout/stderr are flushed, then
    `os._exit` skips interpreter finalization (see the module docstring). For processes that
    were ranks of a process group, after `leave`; files they wrote must be closed before."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can be written
            pass
    os._exit(code)
