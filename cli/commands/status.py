"""One screen on a running stack: policy version, learner step and losses, queue lengths and
backlogs, throughput, staleness, and each service's readiness.

    shellrl status [--state-dir .shellrl] [--watch]
"""

from __future__ import annotations

NAME = "status"
HELP = "versions, queue lengths, throughput and staleness of a running stack"


def add_arguments(parser) -> None:
    parser.add_argument("--state-dir", default=".shellrl")
    parser.add_argument("--watch", action="store_true", help="refresh every 2 s until Ctrl-C")


def run(args) -> int:
    import json
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.live import Live

    from cli.stack_status import collect, render

    pid_file = Path(args.state_dir) / "stack.json"
    if not pid_file.exists():
        Console().print(f"no stack running ({pid_file} missing); start one with `shellrl up`")
        return 1
    info = json.loads(pid_file.read_text())
    if not args.watch:
        Console().print(render(collect(info)))
        return 0
    with Live(render(collect(info)), refresh_per_second=1) as live:
        try:
            while True:
                time.sleep(2)
                live.update(render(collect(info)))
        except KeyboardInterrupt:
            return 0
