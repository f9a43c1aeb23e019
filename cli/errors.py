"""Errors the `shellrl` command reports as one line on stderr, without a traceback."""

from __future__ import annotations


class CliError(Exception):
    """A mistake of the user or the environment (a bad flag value, a config file that does not
    parse, a model directory without a tokenizer, a stack that did not start). `cli.main` prints
    `shellrl <command>: error: <message>` and exits with `exit_status` (2 by default, argparse's
    status for a usage error)."""

    def __init__(self, message: str, exit_status: int = 2) -> None:
        super().__init__(message)
        self.exit_status = exit_status
