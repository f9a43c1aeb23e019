"""Stop the stack that `shellrl up` (or `shellrl run`) started from another terminal.

shellrl down [--state-dir .shellrl]
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from cli.polling import poll_until

NAME = "down"
HELP = "stop a running stack (SIGTERM to its launcher, which stops every process)"


def add_arguments(parser) -> None:
    """The flags of DownOptions (cli/tool_options.py; also SHELLRL_CLI_DOWN_<OPTION>)."""
    from cli.options import add_options
    from cli.tool_options import DownOptions

    add_options(parser, DownOptions)
    parser.set_defaults(_options=DownOptions)


def run(args) -> int:
    return down(Path(args.state_dir), timeout_s=args.timeout_s)


def down(state_dir: Path, timeout_s: float = 60.0) -> int:
    """Stop the stack a `shellrl up` in another terminal started (SIGTERM to its launcher, which
    stops every process; when the launcher is gone, SIGTERM to the process groups its stack.json
    names). Returns 0 once the pid file is gone, 1 after `timeout_s`."""
    pid_file = state_dir / "stack.json"
    if not pid_file.exists():
        print("no stack running (no pid file)")
        return 0
    info = json.loads(pid_file.read_text())
    pid = info["launcher_pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        # launcher gone: stop its children ourselves, by the pids it recorded
        for child in info["processes"].values():
            try:
                os.killpg(child, signal.SIGTERM)
            except ProcessLookupError:
                pass
        pid_file.unlink(missing_ok=True)
        return 0
    gone = poll_until(lambda: not pid_file.exists(), timeout_s=timeout_s, interval_s=0.2)
    return 0 if gone else 1
