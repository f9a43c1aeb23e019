"""The infrastructure experiments on the real stack, each with a report and its plots under
`<state-dir>/experiments/<name>/` (report.md, results.json, *_vs_wall_clock.png,
*_vs_trained_tokens.png), and its table printed (cli/experiments/).

    shellrl experiment concurrency           # 1/4/8/16 environments (concurrent episodes)
    shellrl experiment long-tail             # batch barrier vs continuous admission, 10 s / 80 s
    shellrl experiment staleness             # sync vs async k = 1, 2, 4
    shellrl experiment all --quick           # the three, short (what `make bench` runs)
    shellrl experiment long-tail --model-path smollm2 --device cuda --scale 1

On the CPU the tiny model runs and episode durations are scaled by --scale (default 0.1; 1 with
--device cuda); the report states the scale.
"""

from __future__ import annotations

NAME = "experiment"
HELP = "infrastructure experiments (concurrency, long tail, staleness): report, plots, table"


def add_arguments(parser) -> None:
    """NAME, then the flags of ExperimentOptions (cli/tool_options.py; also
    SHELLRL_CLI_EXPERIMENT_<OPTION>)."""
    from cli.experiments.workload import NAMES
    from cli.options import add_options
    from cli.tool_options import ExperimentOptions

    parser.add_argument("name", choices=(*NAMES, "all"), help="which experiment (all: the three)")
    add_options(parser, ExperimentOptions)
    parser.set_defaults(_options=ExperimentOptions)


def _experiments(args) -> list:
    from cli.errors import CliError
    from cli.experiments import workload

    scale = args.scale if args.scale is not None else (1.0 if args.device == "cuda" else 0.1)
    if scale <= 0 or (args.window_s is not None and args.window_s <= 0):
        raise CliError("--scale and --window-s must be > 0")
    names = workload.NAMES if args.name == "all" else (args.name,)
    try:
        return [
            workload.build(
                name,
                scale=scale,
                quick=args.quick,
                window_s=args.window_s,
                levels=tuple(args.levels) if args.levels else None,
                ks=tuple(args.ks) if args.ks else None,
            )
            for name in names
        ]
    except ValueError as exc:
        raise CliError(str(exc)) from None


def run(args) -> int:
    import shlex
    import sys
    import time
    from pathlib import Path

    from cli.console import cli_console
    from cli.errors import CliError
    from cli.experiments.report import rich_table, write_report
    from cli.experiments.runner import StackOptions, run_experiment
    from cli.model_path import check_model_path
    from cli.stack_config import check_device
    from cli.stack_failure import StackError

    check_device(args.device, None, "colocated")
    check_model_path(args.model_path)
    console = cli_console()
    command = shlex.join(["shellrl", *sys.argv[1:]]) if sys.argv[1:] else "shellrl experiment"
    for exp in _experiments(args):
        out = Path(args.state_dir) / "experiments" / exp.name
        console.print(f"[bold]experiment {exp.name}[/]: {exp.title}")
        start = time.time()
        try:
            results = run_experiment(
                exp,
                StackOptions(out / "stack", args.model_path, args.device, args.threads),
                on_point=lambda r: console.print(
                    f"  measured: {r.name} (its services started in {r.start_s:.0f} s)"
                ),
            )
        except StackError as exc:
            raise CliError(f"{exp.name}: {exc}", exit_status=1) from None
        info = {
            "command": command,
            "model_path": args.model_path,
            "device": args.device,
            "threads": args.threads,
            "seconds": time.time() - start,
        }
        report = write_report(out, exp, results, info)
        console.print(rich_table(exp, results))
        console.print(f"[bold green]report written:[/] {report}")
    return 0
