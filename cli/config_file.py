"""`--config FILE` of `shellrl run` and `shellrl up`: a TOML file of the command's options.

    # shellrl.toml
    model-path = "tiny"          # a long option of the command, without '--' ('-' or '_')
    steps = 20
    require-command = true       # a switch: true / false
    [run]                        # only for `shellrl run` (overrides the top level there)
    time-budget-min = 10
    [env]                        # SHELLRL_* settings of the services the command starts
    SHELLRL_MAX_SESSIONS = 64

The file's values become the command's defaults, so a flag on the command line overrides them.
Top-level keys must be options of the command that reads the file; a table is a command's name
(read by that command only) or `env`. Every mistake (missing file, TOML syntax, unknown key, value
of the wrong type, a `SHELLRL_` name that is no service's setting, an `[env]` value that the
setting's own service would refuse: `check_env_values`) raises CliError with one line naming the
file and the key, before any process starts. `[env] SHELLRL_PORT` is refused: the launcher gives
each service its port (`--port-offset` moves them all).
"""

from __future__ import annotations

import argparse
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


def apply_config(
    parser: argparse.ArgumentParser, path: str | Path, command: str, commands: tuple[str, ...] = ()
) -> dict:
    """Set `parser`'s defaults from the file at `path` for `command`; returns them. The `[env]`
    table lands in the default of `config_env` ({SHELLRL_NAME: str}). commands: every command's
    name (a table named after another command is skipped; any other table is an error)."""
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
    env = _env(path, data.get(ENV_TABLE, {}))
    defaults = {"config_env": env}
    by_dest = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    by_option = {
        o.removeprefix("--"): a
        for a in parser._actions
        for o in a.option_strings
        if o.startswith("--")
    }
    for key, value in values.items():
        name = key.replace("_", "-")
        action = by_option.get(name)
        if action is not None and action.dest in by_dest:
            dest, converted = action.dest, _convert(path, key, action, value, by_flag=True)
        elif (action := by_dest.get(name.replace("-", "_"))) is not None:
            dest, converted = action.dest, _convert(path, key, action, value, by_flag=False)
        else:
            known = sorted(o for o, a in by_option.items() if a.dest in by_dest)
            raise CliError(
                f"config file {path}: unknown option {key!r} for `shellrl {command}` "
                f"(known: {', '.join(known)})"
            )
        defaults[dest] = converted
    parser.set_defaults(**defaults)
    return defaults


def _convert(path, key: str, action: argparse.Action, value, by_flag: bool):
    where = f"config file {path}: {key}"
    if action.nargs == 0:  # a switch (store_true / store_false)
        if not isinstance(value, bool):
            raise CliError(f"{where}: expected true or false, got {value!r}")
        if by_flag:  # `no-require-command = true` means the flag was given
            return action.const if value else not action.const
        return value
    kind = action.type
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise CliError(f"{where}: expected {getattr(kind, '__name__', 'a string')}, got {value!r}")
    if kind is float and isinstance(value, int):
        value = float(value)
    elif kind is None:
        if not isinstance(value, str):
            raise CliError(f"{where}: expected a string, got {value!r}")
    elif not isinstance(value, kind if isinstance(kind, type) else object):
        if not isinstance(value, str):
            raise CliError(f"{where}: expected {kind.__name__}, got {value!r}")
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise CliError(
                f"{where}: expected {getattr(kind, '__name__', 'a value')}, got {value!r}"
            ) from None
    if action.choices is not None and value not in action.choices:
        raise CliError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


# set by the launcher for each service; the option that moves them instead
LAUNCHER_SETTINGS = {"SHELLRL_PORT": "--port-offset N (every port of the stack moved by N)"}


def _env(path, table: dict) -> dict[str, str]:
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
