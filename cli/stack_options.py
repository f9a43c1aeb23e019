"""Checks and options shared by the commands that start a stack beyond their typed options
(cli/options.py): the tracker's package, and `--port-offset` for `shellrl eval`."""

from __future__ import annotations


def check_tracker(tracker: str) -> None:
    """Raise CliError (before anything starts) when `tracker`'s package is not installed."""
    from cli.errors import CliError
    from shellrl.tracking import PACKAGES, installed

    if tracker in PACKAGES and not installed(tracker):
        raise CliError(f"--tracker {tracker}: pip install {PACKAGES[tracker]}")


def add_port_offset_argument(parser) -> None:
    """--port-offset: every port of the stack (Redis and each service) moved by N."""
    from cli.stack_config import default_ports_text

    parser.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="N",
        help="move every port of the stack by N, so that a second stack can run beside the "
        f"first (with a --state-dir of its own); the default ports: {default_ports_text()}",
    )
