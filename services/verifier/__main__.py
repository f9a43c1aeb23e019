"""`python -m services.verifier [--host H] [--port P]`: the verifier service (HTTP + stream worker)."""

from __future__ import annotations

import argparse

from services.verifier.app import build_app
from services.verifier.settings import VerifierSettings
from shellrl.service.app import serve
from shellrl.service.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.verifier", description=__doc__)
    parser.add_argument("--host", help="interface to bind (default: SHELLRL_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: SHELLRL_PORT or 8102)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = VerifierSettings.from_env_or_exit(**overrides)
    setup_logging("verifier", settings.log_level)
    serve(build_app(settings), settings.host, settings.listen_port, settings.log_level, settings.shutdown_grace_s)


if __name__ == "__main__":
    main()
