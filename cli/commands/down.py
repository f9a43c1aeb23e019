"""Stop the stack that `shellrl up` (or `shellrl run`) started from another terminal.

shellrl down [--state-dir .shellrl]
"""

from __future__ import annotations

NAME = "down"
HELP = "stop a running stack (SIGTERM to its launcher, which stops every process)"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--state-dir", default=".shellrl", help="the stack's state directory (its stack.json)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=90.0, help="seconds to wait for the stack to stop"
    )


def run(args) -> int:
    from pathlib import Path

    from cli.launcher import down

    return down(Path(args.state_dir), timeout_s=args.timeout_s)
