"""Settings base: every service extends `ServiceSettings` (pydantic-settings, `SHELLRL_` prefix).

Fields carry their unit in the name (`timeout_s`, `max_output_bytes`); `extra="forbid"` makes a
mistyped setting fail at start-up naming the field. Built in each service's `__main__`, never at
import time.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    """Settings every service shares. Environment: `SHELLRL_<FIELD>` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="SHELLRL_", extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Interface the HTTP server binds to.")
    port: int = Field(0, ge=0, le=65535, description="HTTP port; 0 = the service's default port.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the streams.")
    log_level: str = Field("INFO", description="stdlib logging level name.")
    shutdown_grace_s: float = Field(10.0, ge=0, description="Drain time for in-flight work on SIGTERM.")

    def public_dict(self) -> dict:
        """The resolved config for logs and `GET /v1/config` (secrets never live in settings)."""
        return self.model_dump(mode="json")
