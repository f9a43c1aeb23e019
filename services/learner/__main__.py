"""`python -m services.learner [--host H] [--port P]`: the learner service (HTTP + training loop)."""

from __future__ import annotations

import sys

from services.learner.allocator import reexec_with_jemalloc


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    reexec_with_jemalloc("services.learner", argv)  # before torch allocates anything (allocator.py)
    from services.learner.app import build_app
    from services.learner.settings import LearnerSettings
    from shellrl.service.main import run_service

    run_service("learner", LearnerSettings, build_app, argv, description=__doc__)


if __name__ == "__main__":
    main()
