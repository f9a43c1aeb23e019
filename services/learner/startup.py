"""`python -m services.learner [--host H] [--port P]`: the learner service (HTTP + training loop).

`torchrun --nproc-per-node N -m services.learner` runs it data-parallel: rank 0 is the service
(and holds the learner lock in Redis), the other ranks follow it (follower.py, data_parallel.py).

Start-up, around `run_service` (__main__.py calls `main`): re-exec under jemalloc before torch
allocates (allocator.py); a rank other than 0 follows rank 0 (follower.py); rank 0 takes the
learner lock (learner_lock.py: one learner per stream), joins the ranks (ranks.py), renews the
lock while it serves and releases it on exit and on SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from services.learner.allocator import reexec_with_jemalloc
from shellrl.process_groups import exit_process

log = logging.getLogger("services.learner")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    reexec_with_jemalloc("services.learner", argv)  # before torch allocates anything (allocator.py)
    import redis

    from services.learner.learner_lock import LearnerLock, LearnerLockHeld
    from services.learner.settings import LearnerSettings

    if {"-h", "--help"} & set(argv):
        _serve(argv)
        return
    settings = LearnerSettings.from_env_or_exit()
    if int(os.environ.get("RANK", "0")) > 0:
        from services.learner.follower import run_follower

        run_follower(settings)
        exit_process(0)  # a rank never meets the interpreter's finalization (process_groups)
    lock = LearnerLock(
        redis.Redis.from_url(settings.redis_url),
        name=settings.consumer_name,
        port=settings.listen_port,
        ttl_s=settings.lock_ttl_s,
    )
    try:
        lock.acquire()
    except (LearnerLockHeld, redis.ConnectionError) as exc:
        raise SystemExit(f"learner: {exc}") from None
    from services.learner.ranks import current, join_ranks  # imports torch

    try:
        ranks = join_ranks(settings)
        lock.start_renewing(on_lost=_stop_when_lost)
        # uvicorn re-raises the SIGTERM it handled once the server has shut down (with the
        # handler found before it): release the lock then, and die of the signal as before
        signal.signal(signal.SIGTERM, lambda signum, _: _release_and_die(lock, signum))
        _serve(argv)
    finally:
        lock.release()
        current().close()  # a no-op after DataParallel.stop left the group
    if ranks.control is not None:
        exit_process(0)  # a rank never meets the interpreter's finalization (process_groups)


def _serve(argv: list[str]) -> None:
    from services.learner.app import build_app
    from services.learner.settings import LearnerSettings
    from shellrl.service.main import run_service

    run_service("learner", LearnerSettings, build_app, argv, description=__doc__)


def _stop_when_lost(holder: str) -> None:
    log.error("the learner lock is held by another learner; stopping", extra={"holder": holder})
    os.kill(os.getpid(), signal.SIGTERM)


def _release_and_die(lock, signum: int) -> None:
    lock.release()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
