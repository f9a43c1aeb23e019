"""Settings base: every service extends `ServiceSettings` (pydantic-settings, `SHELLRL_` prefix).

Fields carry their unit in the name (`timeout_s`, `max_output_bytes`); `extra="forbid"` makes a
mistyped setting fail at start-up naming the field. Built in each service's `__main__`, never at
import time.
"""

from __future__ import annotations

import difflib
import os

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SHELLRL_"


class ServiceSettings(BaseSettings):
    """Settings every service shares. Environment: `SHELLRL_<FIELD>` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="SHELLRL_", extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Interface the HTTP server binds to.")
    port: int = Field(0, ge=0, le=65535, description="HTTP port; 0 = the service's default port.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the streams.")
    log_level: str = Field("INFO", description="stdlib logging level name.")
    shutdown_grace_s: float = Field(10.0, ge=0, description="Drain time for in-flight work on SIGTERM.")

    @model_validator(mode="after")
    def _no_mistyped_env(self):
        """`extra="forbid"` covers constructor arguments only: pydantic-settings ignores unknown
        environment variables. A `SHELLRL_` variable that is no field of this service but close to
        one (`SHELLRL_REDIS_ULR`) is a typo: fail naming it. Unrelated ones (another service's
        settings in a shared environment) pass; so do singular/plural twins (`engine_url` vs
        `engine_urls`), which are different settings of different services."""
        unknown = unknown_env_settings(type(self))
        for name, close in unknown.items():
            if close:
                raise ValueError(f"{ENV_PREFIX}{name.upper()}: unknown setting; did you mean "
                                 f"{ENV_PREFIX}{close.upper()}?")
        return self

    def public_dict(self) -> dict:
        """The resolved config for logs and `GET /v1/config` (secrets never live in settings)."""
        return self.model_dump(mode="json")


def unknown_env_settings(cls: type[BaseSettings], environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """`SHELLRL_*` environment variables that are no field of `cls`: {field-like name: the field it
    is probably a typo of, or None}."""
    environ = os.environ if environ is None else environ
    fields = set(cls.model_fields)
    out: dict[str, str | None] = {}
    for var in environ:
        if not var.upper().startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name in fields:
            continue
        twins = {name + "s", name.removesuffix("s")}
        matches = [m for m in difflib.get_close_matches(name, fields, n=1, cutoff=0.8) if m not in twins]
        out[name] = matches[0] if matches else None
    return out
