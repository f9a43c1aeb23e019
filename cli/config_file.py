"""`--config FILE` of `shellrl run` and `shellrl up`: a TOML file of the command's options.

    # shellrl.toml
    model-path = "tiny"          # a long option of the command, without '--' ('-' or '_')
    no-require-command = true    # a switch: true / false
    [run]                        # only for `shellrl run` (overrides the top level there)
    steps = 20                   # an option of `run` only: at the top level `up` refuses it
    time-budget-min = 10
    [env]                        # SHELLRL_* settings of the services the command starts
    SHELLRL_MAX_SESSIONS = 64

The options are the fields of the command's typed model (cli/options.py: RunOptions, UpOptions),
which reads this file below the flags and the environment (SHELLRL_CLI_<OPTION>). A table is a
command's name (read by that command only) or `env`. Every mistake (missing file, TOML syntax,
unknown key, value of the wrong type, a `SHELLRL_` name that is no service's setting, an `[env]`
value that the setting's own service would refuse: `check_env_values`) raises CliError with one
line naming the file and the key, before any process starts. `[env] SHELLRL_PORT` is refused: the
launcher gives each service its port (`--port-offset` moves them all).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from cli.errors import CliError

ENV_TABLE = "env"


def read(path: str | Path) -> dict:
    """The parsed TOML file. Raises CliError when it is missing or does not parse."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise CliError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CliError(f"config file {path}: {exc}") from None


def command_values(
    path: str | Path, command: str, commands: tuple[str, ...] = ()
) -> tuple[dict, dict[str, str]]:
    """The file's option values for `command` (the top level, then its own table over it) and
    its [env] table ({SHELLRL_NAME: str}, checked: `env_table`). commands: every command's name
    (a table named after another command is skipped; any other table is an error)."""
    data = read(path)
    values = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in (command, ENV_TABLE, *commands):
                raise CliError(
                    f"config file {path}: unknown table [{key}] (tables: [{ENV_TABLE}] and "
                    "one per command, e.g. [run])"
                )
            continue
        values[key] = value
    values |= data.get(command, {})
    return values, env_table(path, data.get(ENV_TABLE, {}))


# set by the launcher for each service; the option that moves them instead
LAUNCHER_SETTINGS = {"SHELLRL_PORT": "--port-offset N (every port of the stack moved by N)"}


def env_table(path, table: dict) -> dict[str, str]:
    """The [env] table as environment strings; each name must be a setting of some service, and
    its value one that every service with that setting accepts (`check_env_values`)."""
    from shellrl.service.settings import ENV_PREFIX, known_setting_names

    known = known_setting_names()
    out = {}
    for name, value in table.items():
        if name.upper() in LAUNCHER_SETTINGS:
            raise CliError(
                f"config file {path}: [{ENV_TABLE}] {name}: set by the launcher for each "
                f"service; use {LAUNCHER_SETTINGS[name.upper()]}"
            )
        field = name.upper().removeprefix(ENV_PREFIX).lower()
        if not name.upper().startswith(ENV_PREFIX) or field not in known:
            raise CliError(
                f"config file {path}: [{ENV_TABLE}] {name}: no service has this setting "
                f"(names are {ENV_PREFIX}<FIELD>, see services/<name>/settings.py)"
            )
        if isinstance(value, (dict, list)):
            raise CliError(f"config file {path}: [{ENV_TABLE}] {name}: expected a single value")
        out[name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        check_env_values(out)
    except ValueError as exc:
        raise CliError(f"config file {path}: [{ENV_TABLE}] {exc}") from None
    return out


def check_env_values(env: dict[str, str]) -> None:
    """Validate each SHELLRL_* value of `env` with the Settings class of every service that has
    that setting (services/<name>/settings.py), read from the environment as the service would
    read it. Raises ValueError with one line, "SHELLRL_NAME='value': <service>: <error>", for the
    first value a service refuses. Only errors of the given settings count (a check across
    settings counts when its message names one of them): the rest of the caller's environment is
    checked when the services start."""
    from pydantic import ValidationError
    from pydantic_settings import EnvSettingsSource

    from shellrl.service.settings import SERVICES

    for service in SERVICES:
        cls = _settings_class(service)
        field_of = _fields_by_env_name(cls)
        mine = {k: v for k, v in env.items() if _bare(k) in field_of}
        if not mine:
            continue
        source = EnvSettingsSource(cls)
        source.env_vars = {k.lower(): v for k, v in mine.items()}  # what the service would read
        try:
            cls(**source())
        except ValidationError as exc:
            for error in exc.errors():
                loc = _bare(str(error["loc"][0])) if error["loc"] else ""
                message = error["msg"].removeprefix("Value error, ")
                for key in mine:
                    field = field_of[_bare(key)]
                    if field_of.get(loc) == field or (not loc and field in message):
                        secret = "SecretStr" in str(cls.model_fields[field].annotation)
                        shown = "'***'" if secret else repr(mine[key])
                        raise ValueError(f"{key}={shown}: {service}: {message}") from None


def _bare(name: str) -> str:
    """'SHELLRL_MAX_SESSIONS' -> 'max_sessions'."""
    from shellrl.service.settings import ENV_PREFIX

    return name.lower().removeprefix(ENV_PREFIX.lower())


def _settings_class(service: str):
    """The ServiceSettings class of services/<service>/settings.py."""
    import importlib

    from shellrl.service.settings import ServiceSettings

    module = importlib.import_module(f"services.{service}.settings")
    return next(
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, ServiceSettings)
        and cls.__module__ == module.__name__
    )


def _fields_by_env_name(cls) -> dict[str, str]:
    """{field name or SHELLRL_ alias, less the prefix: field name} of a settings class."""
    from pydantic import AliasChoices

    out = {}
    for name, info in cls.model_fields.items():
        out[name] = name
        alias = info.validation_alias
        for choice in alias.choices if isinstance(alias, AliasChoices) else [alias]:
            if isinstance(choice, str):
                out[_bare(choice)] = name
    return out
