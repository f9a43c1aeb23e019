"""The values of a command's typed options (cli/options.py): `resolve` completes the flags given
from the environment (`SHELLRL_CLI_<FIELD>`), the `--config` TOML file and the defaults, and
checks them before anything starts. Every value refused is a CliError of one line naming where it
came from: the flag (`--steps`), the variable (`SHELLRL_CLI_STEPS`) or the file's key as spelled
there (`config file shellrl.toml: steps`); a recipe option is also checked as the services will
read it (the SHELLRL_* settings it sets, by their Settings classes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pydantic import ValidationError

from cli.errors import CliError
from cli.options import (
    ENV_PREFIX,
    FileValues,
    Options,
    StackOptions,
    choices_of,
    field_extra,
    flag_of,
    is_inverted,
    is_switch,
)
from cli.recipe import Recipe


def resolve(args: argparse.Namespace, model: type[Options], command: str) -> argparse.Namespace:
    """`args` (flags given) completed from the environment, the config file (a model with a
    `config` field only) and the defaults: every field of `model` set (a None one from its
    `fallback_env` variable when set), plus `config_env` (the file's [env] table). Raises
    CliError (one line naming the flag, variable or file key) for any value the model refuses."""
    from cli.config_file import command_values

    given = {k: v for k, v in vars(args).items() if k in model.model_fields}
    _check_env_names()
    path = None
    if "config" in model.model_fields:
        path = given.get("config") or os.environ.get(ENV_PREFIX + "CONFIG")
    file_values, config_env, spelled = {}, {}, {}
    if path:
        file_values, config_env = command_values(Path(path), command, args._commands)
        spelled = _check_file_keys(path, file_values, model, command)
    FileValues.values = file_values
    try:
        options = model(**given)
    except ValidationError as exc:
        raise CliError(_first_error(exc, given, spelled, path, model)) from None
    finally:
        FileValues.values = {}
    if issubclass(model, StackOptions):
        _check_recipe(options, given, spelled, path)
    for name in model.model_fields:
        setattr(args, name, getattr(options, name))
    for name, variable in model.fallback_env.items():
        if getattr(args, name) is None:
            setattr(args, name, os.environ.get(variable))
    args.config_env = config_env
    return args


def _check_env_names() -> None:
    """Every SHELLRL_CLI_* variable names an option of a command with a typed model
    (cli/command_options.py's MODELS; one command's option is ignored by the others). Raises
    CliError naming a mistyped one, which pydantic-settings would skip silently (extra="forbid"
    covers flags and file keys only)."""
    from cli.command_options import MODELS

    known = {_env_name(name, m) for m in MODELS.values() for name in m.model_fields}
    for var in sorted(os.environ):
        if var.upper().startswith(ENV_PREFIX) and var.upper() not in known:
            raise CliError(
                f"{var}: no option of a `shellrl` command ({', '.join(MODELS)}) has this name "
                f"({ENV_PREFIX}<OPTION>, {ENV_PREFIX}<COMMAND>_<OPTION>: docs/config.md)"
            )


def _env_name(name: str, model: type[Options]) -> str:
    """The environment variable of field `name` of `model` (SHELLRL_CLI_STEPS,
    SHELLRL_CLI_EVAL_EPISODES)."""
    return model.model_config["env_prefix"] + name.upper()


def _check_file_keys(path, values: dict, model: type[Options], command: str) -> dict[str, str]:
    """Every key is a field the file may set (a switch's own flag too: `no-require-command =
    true`), and a switch's value is a bool. Rewrites each key to its field in place; returns
    {field: the key as the file spells it}."""
    spelled = {}
    keys = {n: n for n, info in model.model_fields.items() if field_extra(info).get("file", True)}
    inverted = {
        flag_of(n, info).removeprefix("--").replace("-", "_"): n
        for n, info in model.model_fields.items()
        if is_inverted(n, info)
    }
    for key in list(values):
        name = key.replace("-", "_")
        if name in inverted:
            value = values.pop(key)
            if not isinstance(value, bool):
                raise CliError(f"config file {path}: {key}: expected true or false, got {value!r}")
            values[inverted[name]], spelled[inverted[name]] = not value, key
        elif name in keys:
            values[name], spelled[name] = values.pop(key), key
            info = model.model_fields[name]
            if isinstance(values[name], bool) and not is_switch(info):
                kind = getattr(info.annotation, "__name__", "a string")
                raise CliError(f"config file {path}: {key}: expected {kind}, got {values[name]!r}")
        else:
            known = sorted(
                [n.replace("_", "-") for n in keys] + [n.replace("_", "-") for n in inverted]
            )
            raise CliError(
                f"config file {path}: unknown option {key!r} for `shellrl {command}` "
                f"(known: {', '.join(known)})"
            )
    return spelled


EXPECTED = {
    "int_parsing": "expected int",
    "int_from_float": "expected int",
    "int_type": "expected int",
    "float_parsing": "expected float",
    "float_type": "expected float",
    "string_type": "expected a string",
}


def _first_error(exc: ValidationError, given: dict, spelled: dict, path, model) -> str:
    """One line for the first error: where the value came from (the flag, the file's key as
    spelled there, else the environment), what was expected."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else ""
    value = error.get("input")
    if error["type"] in EXPECTED:
        message = f"{EXPECTED[error['type']]}, got {value!r}"
    elif error["type"] == "literal_error":
        choices = choices_of(model.model_fields[name])
        message = f"{value!r} is not one of {', '.join(map(str, choices))}"
    else:
        message = error["msg"].removeprefix("Value error, ")
    return f"{_where(name, given, spelled, path, model)}: {message}"


def _where(name: str, given: dict, spelled: dict, path, model: type[Options]) -> str:
    """Where field `name`'s value came from: its flag, the file's key as spelled there, else the
    environment."""
    if name in given:
        return flag_of(name, model.model_fields[name])
    if name in spelled:
        return f"config file {path}: {spelled[name]}"
    return _env_name(name, model)


def _check_recipe(options: StackOptions, given: dict, spelled: dict, path) -> None:
    """Each recipe option not at its default, as the services will read it: the SHELLRL_*
    settings it sets (cli/recipe.py), checked by the Settings class of every service that has
    them (cli/config_file.check_env_values), so that `--group-size 0` stops here, naming the
    option, rather than once Redis and three services have started. Raises CliError."""
    from dataclasses import fields, replace

    from cli.config_file import check_env_values

    base = Recipe()
    for field in fields(Recipe):
        value = getattr(options, field.name)
        if value == getattr(base, field.name):
            continue
        changed = replace(base, **{field.name: value})
        for old, new in zip(_recipe_envs(base), _recipe_envs(changed), strict=True):
            try:
                check_env_values({k: v for k, v in new.items() if old.get(k) != v})
            except ValueError as exc:
                where = _where(field.name, given, spelled, path, type(options))
                raise CliError(f"{where}: {exc}") from None


def _recipe_envs(recipe: Recipe) -> list[dict[str, str]]:
    """The recipe's SHELLRL_* settings: those of every service, then one service's each."""
    return [recipe.env(), *recipe.service_env().values()]
