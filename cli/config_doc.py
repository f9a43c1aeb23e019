"""docs/config.md: a table of every typed command's options (cli/options.py,
cli/command_options.py, cli/tool_options.py), written by `python -m cli.config_doc >
docs/config.md`; tests/unit/test_cli_typed_options.py checks the file is current."""

from __future__ import annotations

from cli.command_options import MODELS
from cli.options import flag_of


def markdown() -> str:
    """The page: an introduction, then a section per command of MODELS with a row per option
    (flag, environment variable, default, meaning)."""
    lines = [
        "# Options of the `shellrl` commands",
        "",
        "Generated from the typed models in `cli/options.py`, `cli/command_options.py` and"
        " `cli/tool_options.py`"
        " (`python -m cli.config_doc > docs/config.md`). Each option is a flag and an environment"
        " variable, and for `run` and `up` also a key of a `--config` TOML file (top level or the"
        " command's table; `-` or `_`); a flag beats the environment, which beats the file. The"
        " variables of every other command name it (`SHELLRL_CLI_EVAL_EPISODES`,"
        " `SHELLRL_CLI_PASS_RATES_TEMPERATURE`), since a word such as `temperature` or `state_dir`"
        " means another thing to `run` and `up`. Positional arguments (`submit FILE`, `show ID`,"
        " `export CHECKPOINT OUT`, `experiment NAME`) and `report --compare DIR [DIR ...]` (a"
        " required flag) are not options: they have no variable. A list option's variable"
        " (`SHELLRL_CLI_EXPERIMENT_LEVELS`) holds its values separated by spaces or commas."
        " A config file's `[env]` table sets the services' own `SHELLRL_*` settings"
        " (`services/<name>/settings.py`), except those an option sets.",
    ]
    for command, model in MODELS.items():
        prefix = model.model_config["env_prefix"]
        lines += ["", f"## shellrl {command}", "", "| flag | environment | default | meaning |"]
        lines.append("| --- | --- | --- | --- |")
        for name, info in model.model_fields.items():
            text = (info.description or "").replace("|", "\\|")
            default = "''" if info.default == "" else info.default
            row = f"`{flag_of(name, info)}` | `{prefix}{name.upper()}` | `{default}`"
            lines.append(f"| {row} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
