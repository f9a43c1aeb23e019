"""docs/config.md: a table of every typed command's options (cli/options.py, cli/command_options.py),
written by `python -m cli.config_doc > docs/config.md`; tests/unit/test_cli_typed_options.py
checks the file is current."""

from __future__ import annotations

from cli.command_options import MODELS
from cli.options import flag_of


def markdown() -> str:
    """The page: an introduction, then a section per command of MODELS with a row per option
    (flag, environment variable, default, meaning)."""
    lines = [
        "# Options of `shellrl up`, `run`, `eval`, `submit` and `show`",
        "",
        "Generated from the typed models in `cli/options.py` and `cli/command_options.py`"
        " (`python -m cli.config_doc > docs/config.md`). Each option is a flag and an environment"
        " variable, and for `run` and `up` also a key of a `--config` TOML file (top level or the"
        " command's table; `-` or `_`); a flag beats the environment, which beats the file. The"
        " variables of `eval`, `submit` and `show` name the command (`SHELLRL_CLI_EVAL_EPISODES`),"
        " since a word such as `temperature` or `state_dir` means another thing to `run` and `up`."
        " A config file's `[env]` table sets the services' own `SHELLRL_*` settings"
        " (`services/<name>/settings.py`), except those an option sets.",
    ]
    for command, model in MODELS.items():
        prefix = model.model_config["env_prefix"]
        lines += ["", f"## shellrl {command}", "", "| flag | environment | default | meaning |"]
        lines.append("| --- | --- | --- | --- |")
        for name, info in model.model_fields.items():
            text = (info.description or "").replace("|", "\\|")
            row = f"`{flag_of(name, info)}` | `{prefix}{name.upper()}` | `{info.default}`"
            lines.append(f"| {row} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
