"""Settings base: every service extends `ServiceSettings` (pydantic-settings, `SHELLRL_` prefix).

Fields carry their unit in the name (`timeout_s`, `max_output_bytes`); `extra="forbid"` makes a
mistyped setting fail at start-up naming the field. Built in each service's `__main__`, never at
import time.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shellrl.service.auth import check_token

ENV_PREFIX = "SHELLRL_"


def parse_shard_urls(value: str) -> list[str]:
    """The Redis URLs of stream shards 1..N from `stream_shard_urls` (comma-separated; blanks
    ignored). Raises ValueError for a URL that is not redis://, rediss:// or unix://, or for one
    given twice."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    for url in urls:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"stream shard URL {url!r} is not a redis://, rediss:// or unix:// URL"
            )
    if len(set(urls)) != len(urls):
        raise ValueError(f"a stream shard URL is given twice: {urls}")
    return urls


class ServiceSettings(BaseSettings):
    """Settings every service shares. Environment: `SHELLRL_<FIELD>` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="SHELLRL_", extra="forbid", frozen=True)
    default_port: ClassVar[int] = 0  # each service sets its own (the port when `port` is 0)

    host: str = Field("127.0.0.1", description="Interface the HTTP server binds to.")
    port: int = Field(0, ge=0, le=65535, description="HTTP port; 0 = the service's default port.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the streams.")
    stream_shard_urls: str = Field(
        "",
        description="Redis instances that hold the training episodes and trajectories instead "
        "of redis_url (comma-separated URLs; empty: every stream on redis_url): a group's "
        "episodes go to shard 1 + crc32(group_id) mod N (shellrl/streams/shards.py); admission, "
        "the task pool and evaluations stay on redis_url. The rollout gateways, verifiers and "
        "learner of one run must list the same URLs in the same order.",
    )
    log_level: str = Field("INFO", description="stdlib logging level name.")
    shutdown_grace_s: float = Field(
        10.0, ge=0, description="Drain time for in-flight work on SIGTERM."
    )
    api_token: SecretStr | None = Field(
        None,
        description="The stack's shared bearer token (shellrl/service/auth.py): callers send "
        "`Authorization: Bearer <token>`, this service's clients send it to the others. "
        "Served as '**********' in /v1/config.",
    )
    api_token_file: Path | None = Field(
        None,
        description="File holding the token instead (a mounted Kubernetes or compose secret); "
        "read at start-up, surrounding whitespace dropped.",
    )
    auth_disabled: bool = Field(
        False,
        description="Serve without a token: local development only. Start-up refuses to run "
        "with neither a token nor this.",
    )

    @model_validator(mode="after")
    def _no_mistyped_env(self):
        """`extra="forbid"` covers constructor arguments only: pydantic-settings ignores unknown
        environment variables. A `SHELLRL_` variable that is no field of this service but one typo
        away from one (`SHELLRL_REDIS_ULR`: one insertion, deletion, substitution or swap of
        neighbours) fails naming both. Anything further away passes, because a shared environment
        (compose `.env`, the launcher) carries the other services' settings too; a singular/plural
        twin of a field passes only if it is some service's setting (`SHELLRL_NUM_THREAD` fails).
        tests/unit/test_settings.py checks that no two services' settings are one typo apart.
        One of this service's fields with the service's name in front
        (`SHELLRL_SANDBOX_WARM_POOL_PER_SETUP` for the sandbox's `warm_pool_per_setup`) fails too,
        unless that name is some service's setting or alias (`service_prefixed`)."""
        own = set(type(self).model_fields)
        for name, close in unknown_env_settings(type(self)).items():
            twin = next(
                (t for t in (name + "s", name.removesuffix("s")) if t != name and t in own), None
            )
            if not close and twin and name not in known_setting_names():
                close = twin
            if not close:
                close = service_prefixed(name, own, service_of(type(self)))
            if close:
                raise ValueError(
                    f"{ENV_PREFIX}{name.upper()}: unknown setting; did you mean "
                    f"{ENV_PREFIX}{close.upper()}?"
                )
        return self

    @model_validator(mode="after")
    def _stream_shards(self):
        """`stream_shard_urls` parses (`shard_urls`) and does not repeat redis_url."""
        try:
            urls = parse_shard_urls(self.stream_shard_urls)
        except ValueError as exc:
            raise ValueError(f"stream_shard_urls: {exc}") from None
        if self.redis_url in urls:
            raise ValueError(
                f"stream_shard_urls: {self.redis_url!r} is redis_url (shard 0) already"
            )
        return self

    @property
    def shard_urls(self) -> list[str]:
        """The Redis URLs of stream shards 1..N (`stream_shard_urls`, parsed)."""
        return parse_shard_urls(self.stream_shard_urls)

    @model_validator(mode="after")
    def _one_token_source(self):
        """At most one of api_token, api_token_file, auth_disabled; `api_token` must be a token
        (`check_token`). The file is read by `api_token_value`, at start-up."""
        given = [
            name
            for name, value in (
                ("api_token", self.api_token),
                ("api_token_file", self.api_token_file),
                ("auth_disabled", self.auth_disabled or None),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give one of them, not both")
        if self.api_token is not None:
            self.api_token_value()
        return self

    def api_token_value(self) -> str | None:
        """The token this service requires and sends (None when auth is disabled or not set up).
        Reads `api_token_file` on every call. ValueError naming the setting when the file cannot
        be read or the token is no valid one."""
        if self.api_token is not None:
            try:
                return check_token(self.api_token.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"api_token: {exc}") from None
        if self.api_token_file is None:
            return None
        try:
            return check_token(self.api_token_file.read_text().strip())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"api_token_file {str(self.api_token_file)!r}: {exc}") from None

    @property
    def listen_port(self) -> int:
        """The port to bind: `port`, or the service's `default_port` when `port` is 0."""
        return self.port or self.default_port

    @classmethod
    def from_env_or_exit(cls, **overrides):
        """The settings for a service's `__main__`: environment plus `overrides` (CLI flags). Bad
        settings end the process with one line per error naming the setting (exit status 1), not a
        pydantic traceback."""
        try:
            return cls(**overrides)
        except ValidationError as exc:
            lines = []
            for error in exc.errors():
                where = ".".join(str(p) for p in error["loc"])
                message = error["msg"].removeprefix("Value error, ")
                lines.append(f"{ENV_PREFIX}{where.upper()}: {message}" if where else message)
            raise SystemExit(f"{cls.__name__}: invalid settings\n  " + "\n  ".join(lines)) from None

    def public_dict(self) -> dict:
        """The resolved config for logs, `GET /v1/config` and `/get_server_info`, with every URL's
        password replaced by `***` (`SHELLRL_REDIS_URL=redis://:pw@host/0` carries one). Fields named
        `*_urls` are comma-separated lists; any other string field is one value."""
        out = {}
        for key, value in self.model_dump(mode="json").items():
            if isinstance(value, str):
                value = (
                    ",".join(map(redact_url, value.split(",")))
                    if key.endswith("_urls")
                    else redact_url(value)
                )
            out[key] = value
        return out


def redact_url(value: str) -> str:
    """A URL with its password (`user:secret@`, or a `password=` query parameter as redis-py
    accepts) replaced by `***`; a string that is no URL with a password comes back unchanged."""
    if "://" not in value:
        return value
    try:
        parts = urlsplit(value)
        password = parts.password
    except ValueError:
        return value
    netloc, query = parts.netloc, parts.query
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{host}"
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in pairs):
            query = urlencode(
                [(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*"
            )
    if (netloc, query) == (parts.netloc, parts.query):
        return value
    return urlunsplit(parts._replace(netloc=netloc, query=query))


class EngineFleetSettings(ServiceSettings):
    """Settings of a service that talks to inference engines (rollout, learner)."""

    engine_urls: str = Field(
        "http://127.0.0.1:30000",
        description="Comma-separated seed engine base URLs (SGLang API); the learner pushes "
        "weights to every one. Engines that register themselves in shellrl:engines join at run "
        "time ('' = registered engines only; shellrl.clients.engine_registry).",
    )
    engine_refresh_s: float = Field(
        1.0,
        gt=0,
        description="How often the engine registry (shellrl:engines, shellrl:engines:sync) is "
        "read again, seconds: joins, leaves and restarts take effect within about this.",
    )

    @property
    def engine_url_list(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.engine_urls.split(",") if u.strip()]


class TrainingScheduleSettings(EngineFleetSettings):
    """What the rollout gateway and the learner must agree on, read by both (DESIGN.md section 5):
    the staleness bound, the groups of one learner step, dynamic sampling. One class, so the two
    services read the same `SHELLRL_MAX_STALENESS`, `SHELLRL_GROUPS_PER_STEP` and
    `SHELLRL_DYNAMIC_SAMPLING` with one description and one default; the rules they feed live in
    `shellrl.rl.staleness` and `shellrl.rl.dynamic_sampling`."""

    groups_per_step: int = Field(
        4,
        ge=1,
        description="Counted groups per learner step (= policy version bump): the learner trains "
        "this many per optimizer step, and the gateway's admission bound grows by this many per "
        "version (services/rollout/admission.py).",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="Versions a trajectory may lag the learner at training time: the learner "
        "drops staler ones (services/learner/group_assembler.py), and the gateway admits a group "
        "only while the bound keeps it within this (shellrl/rl/staleness.py).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: a group whose usable members all score the same "
        "reward gives its admission back at the gateway, so another is admitted in its place, "
        "and does not count toward groups_per_step at the learner, so each step trains "
        "groups_per_step groups with reward variance (shellrl/rl/dynamic_sampling.py).",
    )


SERVICES = ("rollout", "sandbox", "verifier", "learner", "engine")


def service_of(cls: type) -> str | None:
    """The service whose settings `cls` is ("sandbox" for services.sandbox.settings), or None."""
    parts = cls.__module__.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "services" and parts[1] in SERVICES else None


def service_prefixed(name: str, fields: set[str], service: str | None) -> str | None:
    """The field of `fields` that `name` is with `service`'s name in front (`sandbox_` +
    `warm_pool_per_setup`), when `name` itself is no service's setting or `SHELLRL_` alias
    (`sandbox_url` is the rollout gateway's, `sandbox_isolation` an alias of `isolation`) and not
    a compose host port (`SHELLRL_ENGINE_PORT` in .env.example: docker compose reads it, not the
    service); None otherwise."""
    if service is None:
        return None
    rest = name.removeprefix(f"{service}_")
    if rest == name or rest == "port" or rest not in fields or name in known_setting_names():
        return None
    return rest


@cache
def known_setting_names() -> frozenset[str]:
    """The fields of every service's settings classes (services/<name>/settings.py; one image ships
    them all, and each imports only pydantic and this module), and their `SHELLRL_` aliases less
    the prefix (`sandbox_isolation`). A service missing from the checkout is skipped; any other
    import error is raised."""
    import importlib

    names: set[str] = set()
    for service in SERVICES:
        name = f"services.{service}.settings"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, f"services.{service}", "services"):
                raise
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, ServiceSettings):
                names.update(obj.model_fields)
                names.update(env_aliases(obj))
    return frozenset(names)


def env_aliases(cls: type[BaseSettings]) -> set[str]:
    """The `SHELLRL_` environment aliases of `cls`'s fields (AliasChoices), less the prefix and
    lower-cased: {"sandbox_isolation", ...}."""
    out: set[str] = set()
    for field in cls.model_fields.values():
        alias = field.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        for choice in choices:
            if isinstance(choice, str) and choice.upper().startswith(ENV_PREFIX):
                out.add(choice[len(ENV_PREFIX) :].lower())
    return out


def unknown_env_settings(
    cls: type[BaseSettings], environ: dict[str, str] | None = None
) -> dict[str, str | None]:
    """`SHELLRL_*` environment variables that are no field of `cls`: {field-like name: the field it
    is one typo away from, or None}."""
    environ = os.environ if environ is None else environ
    fields = set(cls.model_fields)
    out: dict[str, str | None] = {}
    for var in environ:
        if not var.upper().startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name not in fields:
            out[name] = one_typo_away(name, fields)
    return out


def one_typo_away(name: str, fields: set[str] | list[str]) -> str | None:
    """The field that `name` is one edit from (optimal string alignment distance 1), excluding
    singular/plural twins and names shorter than 4 characters; None if there is none."""
    if len(name) < 4:
        return None
    twins = {name + "s", name.removesuffix("s")}
    for field in sorted(fields):
        if (
            field not in twins
            and abs(len(field) - len(name)) <= 1
            and _osa_distance(name, field) == 1
        ):
            return field
    return None


def _osa_distance(a: str, b: str) -> int:
    """Levenshtein distance where swapping two neighbours also counts as one edit."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]
