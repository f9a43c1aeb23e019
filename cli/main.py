"""`shellrl <command>`: the command line. Every subcommand lives in its own module under
`cli/commands/` (e.g. `cli/commands/submit.py`), found at start-up, so adding one never
touches this file.

A command module defines:

    NAME = "submit"                     # the subcommand (default: the module name)
    HELP = "post a task file"           # one line for `shellrl --help`
    def add_arguments(parser) -> None   # its argparse arguments
    def run(args) -> int                # exit status

and must import nothing heavy at module level (no torch): `shellrl --help` imports every one.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import cli.commands


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shellrl", description="Fully asynchronous RL for LLM agents on shell tasks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in command_modules():
        name = getattr(module, "NAME", module.__name__.rsplit(".", 1)[-1])
        help_text = getattr(module, "HELP", (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else "")
        command = sub.add_parser(name, help=help_text, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        if hasattr(module, "add_arguments"):
            module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
