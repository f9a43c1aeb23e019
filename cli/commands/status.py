"""One screen on a running stack: policy version, learner step and losses, queue lengths and
backlogs, entries lost to trimming (pending entries trimmed away before their group handled them;
per group, in red, once there are any), throughput, staleness, and each service's readiness.

    shellrl status [--state-dir .shellrl] [--watch]

Exit status: 0 when Redis and every service of the stack answer and are ready; 1 when any of them
is down (or not ready), or no stack runs from that state directory. With --watch, the status of
the last screen shown before Ctrl-C. A process of the stack that has exited (a learner killed by
CUDA OOM) is named with its failure class and its log's last error line:

    down: learner (exited: oom: torch.OutOfMemoryError: CUDA out of memory. Tried to ...)

`shellrl run` stops its stack once a service died; then the state directory has no stack and
status prints the summary line of the job's incomplete report (`incomplete: learner oom during
train, ...`).
"""

from __future__ import annotations

NAME = "status"
HELP = "versions, queues, throughput and staleness of a running stack (exit 1: something is down)"


def add_arguments(parser) -> None:
    """The flags of StatusOptions (cli/tool_options.py; also SHELLRL_CLI_STATUS_<OPTION>)."""
    from cli.options import add_options
    from cli.tool_options import StatusOptions

    add_options(parser, StatusOptions)
    parser.set_defaults(_options=StatusOptions)


def run(args) -> int:
    import json
    import sys
    import time
    from pathlib import Path

    from cli.console import cli_console, live_table
    from cli.stack_status import collect, down_causes, render

    pid_file = Path(args.state_dir) / "stack.json"
    if not pid_file.exists():
        err = cli_console(stderr=True, highlight=False)
        err.print(
            f"no stack running ({pid_file} missing); start one with `shellrl up`", markup=False
        )
        summary = Path(args.state_dir) / "report" / "summary.json"
        try:
            last = json.loads(summary.read_text())
        except (OSError, ValueError):
            last = {}
        if last.get("incomplete"):
            err.print(
                f"the last job stopped early: {last.get('line')}", markup=False, soft_wrap=True
            )
        return 1
    info = json.loads(pid_file.read_text())
    console = cli_console()
    snap = collect(info)
    if args.watch:
        with live_table(console) as live:
            live.update(render(snap))
            try:
                while True:
                    time.sleep(2)
                    snap = collect(info)
                    live.update(render(snap))
            except KeyboardInterrupt:
                pass
    else:
        console.print(render(snap))
    if down := down_causes(snap):
        print(f"down: {', '.join(down)}", file=sys.stderr)
        return 1
    return 0
