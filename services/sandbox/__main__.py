"""`python -m services.sandbox [--host H] [--port P]`: probe isolation, then serve the API."""

from __future__ import annotations

from services.sandbox.app import build_app
from services.sandbox.settings import SandboxSettings
from shellrl.service.main import run_service


def main(argv: list[str] | None = None) -> None:
    run_service("sandbox", SandboxSettings, build_app, argv, description=__doc__)


if __name__ == "__main__":
    main()
