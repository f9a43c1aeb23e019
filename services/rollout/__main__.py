"""`python -m services.rollout [--host H] [--port P]`: the rollout gateway (HTTP API + rollout worker)."""

from __future__ import annotations

import argparse

from services.rollout.app import build_app
from services.rollout.settings import RolloutSettings
from shellrl.service.app import serve
from shellrl.service.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.rollout", description=__doc__)
    parser.add_argument("--host", help="interface to bind (default: SHELLRL_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: SHELLRL_PORT or 8100)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = RolloutSettings.from_env_or_exit(**overrides)
    setup_logging("rollout", settings.log_level)
    serve(build_app(settings), settings.host, settings.resolved_port, settings.log_level, settings.shutdown_grace_s)


if __name__ == "__main__":
    main()
