"""The one start-up of every service (`python -m services.<name>`) and the one readiness wait.

A service's `__main__.py` is a few lines:

    from services.rollout.app import build_app
    from services.rollout.settings import RolloutSettings
    from shellrl.service.main import run_service

    def main(argv=None):
        run_service("rollout", RolloutSettings, build_app, argv)

`run_service` parses `--host`/`--port` (plus the service's own `flags`), builds the settings from
the environment and the flags (flags win; bad settings exit with one line per setting), refuses
to start without an API token unless auth is disabled (shellrl/service/auth.py), sets up JSON
logging, calls `build_app(settings)` and serves it until SIGTERM/SIGINT with the settings'
`shutdown_grace_s` for in-flight work.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import tenacity

from shellrl.service.app import serve
from shellrl.service.logging import setup_logging
from shellrl.service.settings import ServiceSettings


@dataclass(frozen=True)
class Flag:
    """One extra command-line flag: `argparse.add_argument(*names, **options)`. The parsed value
    (when given) overrides the setting `dest` (default: the flag's name, dashes as underscores);
    `to_settings` turns it into settings overrides instead (e.g. `--disable-radix-cache`)."""

    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    to_settings: Callable[[Any], dict[str, Any]] | None = None


@dataclass
class Served:
    """What a service's `build_app(settings)` returns when it needs more than the app:
    `on_exit_signal` runs once on the first SIGTERM/SIGINT; `grace_s` replaces `shutdown_grace_s`."""

    app: Any
    on_exit_signal: Callable[[], None] | None = None
    grace_s: float | None = None


def run_service(
    service: str,
    settings_cls: type[ServiceSettings],
    build_app: Callable[[Any], Any],
    argv: Sequence[str] | None = None,
    *,
    flags: Sequence[Flag] = (),
    description: str | None = None,
) -> None:
    """Parse flags, build settings, log, build the app, serve until SIGTERM/SIGINT (see module doc).
    SystemExit with one line per bad setting, or when neither an API token nor auth_disabled is set;
    nothing returns before the server has stopped."""
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{service}",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"Every setting is also a SHELLRL_* environment variable (services/{service}/settings.py); "
        "flags win.",
    )
    parser.add_argument("--host", help="interface to bind (default: SHELLRL_HOST or 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, help=f"port (default: SHELLRL_PORT or {settings_cls.default_port})"
    )
    translate = {}
    for flag in flags:
        action = parser.add_argument(*flag.names, **flag.options)
        if flag.to_settings is not None:
            translate[action.dest] = flag.to_settings
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if value is None or (dest in translate and value is False):
            continue
        overrides.update(translate[dest](value) if dest in translate else {dest: value})
    settings = settings_cls.from_env_or_exit(**overrides)
    try:
        api_token = settings.api_token_value()
    except ValueError as exc:
        raise SystemExit(f"{settings_cls.__name__}: invalid settings\n  {exc}") from None
    if api_token is None and not settings.auth_disabled:
        raise SystemExit(
            f"{settings_cls.__name__}: no API token: set SHELLRL_API_TOKEN or "
            "SHELLRL_API_TOKEN_FILE (what every caller must send as 'Authorization: Bearer "
            "<token>'), or SHELLRL_AUTH_DISABLED=true for local development"
        )
    setup_logging(service, settings.log_level)
    logger = logging.getLogger(f"services.{service}")
    logger.info(
        f"starting {service}",
        extra={"config": settings.public_dict(), "port": settings.listen_port},
    )
    if settings.auth_disabled:
        logger.warning(f"{service}: auth disabled: any caller may use every endpoint")
    built = build_app(settings)
    served = built if isinstance(built, Served) else Served(built)
    grace_s = settings.shutdown_grace_s if served.grace_s is None else served.grace_s
    serve(
        served.app,
        settings.host,
        settings.listen_port,
        settings.log_level,
        grace_s,
        on_exit_signal=served.on_exit_signal,
    )


def wait_until_ready(
    url: str,
    timeout_s: float,
    *,
    process: subprocess.Popen | None = None,
    what: str | None = None,
    poll_s: float = 0.2,
) -> None:
    """Block until `GET {url}/readyz` answers 200. RuntimeError when `process` (the service's
    process, if we started it) exits first, or after `timeout_s` seconds (the message names `what`,
    default the URL). Connection errors and 503s are retried every `poll_s` seconds."""
    what = what or url

    def ready() -> bool:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"{what} exited with status {process.returncode} before it was ready"
            )
        try:
            return httpx.get(f"{url.rstrip('/')}/readyz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    retrying = tenacity.Retrying(  # until ready or the deadline; an exit raises at once
        stop=tenacity.stop_after_delay(timeout_s),
        wait=tenacity.wait_fixed(poll_s),
        retry=tenacity.retry_if_result(lambda ok: not ok),
        retry_error_callback=lambda _state: False,
    )
    if not retrying(ready):
        raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")
