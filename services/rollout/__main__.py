"""`python -m services.rollout [--host H] [--port P]`: the rollout gateway (HTTP API + rollout worker)."""

from __future__ import annotations

from services.rollout.app import build_app
from services.rollout.settings import RolloutSettings
from shellrl.service.main import run_service


def main(argv: list[str] | None = None) -> None:
    run_service("rollout", RolloutSettings, build_app, argv, description=__doc__)


if __name__ == "__main__":
    main()
