"""`python -m services.learner [--host H] [--port P]`: the learner service (HTTP + training loop)."""

from __future__ import annotations

import argparse
import sys

from services.learner.allocator import reexec_with_jemalloc


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    reexec_with_jemalloc("services.learner", argv)  # before torch allocates anything (allocator.py)
    from services.learner.app import build_app
    from services.learner.settings import LearnerSettings
    from shellrl.service.app import serve
    from shellrl.service.logging import setup_logging

    parser = argparse.ArgumentParser(prog="python -m services.learner", description=__doc__)
    parser.add_argument("--host", help="interface to bind (default: SHELLRL_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: SHELLRL_PORT or 8103)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = LearnerSettings.from_env_or_exit(**overrides)
    setup_logging("learner", settings.log_level)
    serve(build_app(settings), settings.host, settings.listen_port, settings.log_level, settings.shutdown_grace_s)


if __name__ == "__main__":
    main()
