"""`shellrl <command>`: the command line. Every subcommand lives in its own module under
`cli/commands/` (e.g. `cli/commands/submit.py`), found at start-up, so adding one never
touches this file.

A command module defines:

    NAME = "submit"                     # the subcommand (default: the module name)
    HELP = "post a task file"           # one line for `shellrl --help`
    def add_arguments(parser) -> None   # its argparse arguments (each with a help text: --help
                                        # shows every default)
    def run(args) -> int                # exit status

and must import nothing heavy at module level (no torch): `shellrl --help` imports every one.
A command whose options are a typed model (cli/options.py: `run`, `up`; cli/command_options.py:
`eval`, `submit`, `show`; cli/tool_options.py: `down`, `status`, `export`, `pass-rates`, `report`,
`experiment`) also reads them from SHELLRL_CLI_* (`run` and `up` from a `--config FILE` TOML file
too, cli/config_file.py); flags override both. A `CliError` raised by a command
is printed as one line on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import cli.commands
from cli.errors import CliError


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and `(default: X)` after every option's help."""


def command_modules() -> list:
    """Every module of cli.commands that defines `run`, in name order."""
    modules = []
    for info in sorted(pkgutil.iter_modules(cli.commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"cli.commands.{info.name}")
        if callable(getattr(module, "run", None)):
            modules.append(module)
    return modules


def version() -> str:
    """The installed package's version (pyproject.toml's), or 'unknown' outside an install."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("shellrl")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shellrl",
        formatter_class=HelpFormatter,
        description="Fully asynchronous RL for LLM agents on shell tasks.",
    )
    parser.add_argument("--version", action="version", version=f"shellrl {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    names = []
    for module in command_modules():
        name = getattr(module, "NAME", module.__name__.rsplit(".", 1)[-1])
        doc = (module.__doc__ or "").strip()
        help_text = getattr(module, "HELP", doc.splitlines()[0] if doc else "")
        command = sub.add_parser(
            name, help=help_text, description=module.__doc__, formatter_class=HelpFormatter
        )
        if hasattr(module, "add_arguments"):
            module.add_arguments(command)
        command.set_defaults(_run=module.run, _parser=command)
        names.append(name)
    parser.set_defaults(_commands=tuple(names))
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `argv`. A command with a typed options model (its `_options` default: cli/options.py)
    gets every option from its flags, SHELLRL_CLI_* and its `--config FILE`, else the default.
    Raises CliError for a config file that is missing, does not parse or names an unknown option,
    and for any value the model refuses."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_options", None) is not None:
        from cli.option_values import resolve

        args = resolve(args, args._options, args.command)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = parse(argv)
        return int(args._run(args) or 0)
    except CliError as exc:
        print(
            f"shellrl {command}: error: {exc}".replace("shellrl : ", "shellrl: "), file=sys.stderr
        )
        return exc.exit_status


if __name__ == "__main__":
    sys.exit(main())
