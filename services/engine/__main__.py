"""`python -m services.engine [--model-path smollm2|tiny|DIR] [--port P] [--num-threads N] [...]`: SGLang's API.

Flags override the environment (`SHELLRL_MODEL_PATH`, `SHELLRL_HOST`, `SHELLRL_PORT`, ...; see
settings.py), e.g. SHELLRL_NUM_THREADS, SHELLRL_PREFIX_CACHE_MAX_BYTES, SHELLRL_SHUTDOWN_GRACE_S.
Loads the model, then serves SGLang's HTTP API until SIGTERM/SIGINT.
"""

from __future__ import annotations

from services.engine.settings import EngineSettings
from shellrl.service.main import Flag, run_service

FLAGS = (
    Flag(("--model-path",)),
    Flag(("--device",)),
    Flag(("--weight-version",)),
    Flag(("--max-running-requests",), {"type": int}),
    Flag(("--num-threads",), {"type": int, "help": "torch intra-op threads (0 = torch's default)"}),
    Flag(
        ("--disable-radix-cache",),
        {"action": "store_true", "help": "turn the prefix cache off"},
        to_settings=lambda _: {"prefix_cache": False},
    ),
)


def build_app(settings: EngineSettings):
    """`services.engine.app.build_app`, imported once the settings are valid (it imports torch)."""
    from services.engine.app import build_app

    return build_app(settings)


def main(argv: list[str] | None = None) -> None:
    run_service("engine", EngineSettings, build_app, argv, flags=FLAGS, description=__doc__)


if __name__ == "__main__":
    main()
