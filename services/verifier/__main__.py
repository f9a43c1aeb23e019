"""`python -m services.verifier [--host H] [--port P]`: the verifier service (HTTP + stream worker)."""

from __future__ import annotations

from services.verifier.app import build_app
from services.verifier.settings import VerifierSettings
from shellrl.service.main import run_service


def main(argv: list[str] | None = None) -> None:
    run_service("verifier", VerifierSettings, build_app, argv, description=__doc__)


if __name__ == "__main__":
    main()
