"""`python -m services.engine [--model-path smollm2|tiny|DIR] [--port P] [--num-threads N] [...]`: SGLang's API.

Flags override the environment (`SHELLRL_MODEL_PATH`, `SHELLRL_HOST`, `SHELLRL_PORT`, ...; see
settings.py). Loads the model, then serves SGLang's HTTP API until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging

from services.engine.settings import EngineSettings
from shellrl.service.app import serve
from shellrl.service.logging import setup_logging

log = logging.getLogger("services.engine")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.engine", description=__doc__.splitlines()[0],
        epilog="Every setting is also a SHELLRL_* environment variable (services/engine/settings.py), e.g. "
               "SHELLRL_NUM_THREADS, SHELLRL_PREFIX_CACHE_MAX_BYTES, SHELLRL_SHUTDOWN_GRACE_S; flags win.")
    parser.add_argument("--model-path")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--device")
    parser.add_argument("--weight-version")
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--num-threads", type=int, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--disable-radix-cache", action="store_true", help="turn the prefix cache off")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None and k != "disable_radix_cache"}
    if args.disable_radix_cache:
        overrides["prefix_cache"] = False
    settings = EngineSettings.from_env_or_exit(**overrides)
    setup_logging("engine", settings.log_level)
    log.info("starting engine", extra={"config": settings.public_dict()})

    from services.engine.app import build_app
    from services.engine.runtime import EngineRuntime

    runtime = EngineRuntime(settings)
    serve(build_app(runtime), settings.host, settings.resolved_port(), settings.log_level, runtime.serve_grace_s,
          on_exit_signal=runtime.on_exit_signal)


if __name__ == "__main__":
    main()
