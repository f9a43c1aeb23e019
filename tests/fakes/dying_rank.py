"""The learner (`python -m services.learner`) with one fault injected: a rank that dies mid-step.

Run by torchrun in place of services.learner: `torchrun ... -m tests.fakes.dying_rank`. In
torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0), rank DIE_RANK kills itself with
SIGKILL right after the first micro-batch's backward of the step that trains version
DIE_AT_VERSION, i.e. while the other ranks wait for it in that step's next collective. Later
attempts (the group torchrun restarts) run the real learner unchanged. Everything else is the
real service; set SHELLRL_MALLOC=system (a jemalloc re-exec would start services.learner
itself, without the fault).
"""

from __future__ import annotations

import os
import signal

from services.learner.__main__ import main
from services.learner.trainer import Trainer


def inject(rank: int, version: int) -> None:
    """Make this process SIGKILL itself mid-step at `version` when it is rank `rank`."""
    if int(os.environ.get("RANK", "0")) != rank:
        return
    step, accumulate = Trainer.step, Trainer._accumulate

    def marked_step(self, batch, learner_version, plan=None):
        self._dying = learner_version == version
        return step(self, batch, learner_version, plan)

    def dying_accumulate(self, *args, **kwargs):
        stats = accumulate(self, *args, **kwargs)
        if getattr(self, "_dying", False):
            os.kill(os.getpid(), signal.SIGKILL)
        return stats

    Trainer.step, Trainer._accumulate = marked_step, dying_accumulate


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        inject(int(os.environ["DIE_RANK"]), int(os.environ["DIE_AT_VERSION"]))
    main()
