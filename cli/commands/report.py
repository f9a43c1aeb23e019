"""Compare runs of the main job: per eval set the mean success before and after with a 95%
interval over runs, per template the solved instances of every run, and the fraction of runs
meeting the target (issue 20: eval_id doubles and gains 10 points, no template loses more than 1
instance, eval_ood does not fall). Writes compare.json, compare.md and compare.png.

    shellrl report --compare runs/seed0 runs/seed1 runs/seed2 --out docs/runs/seeds
"""

from __future__ import annotations

NAME = "report"
HELP = "compare main-job runs: success with intervals over runs, per template, target met"


def add_arguments(parser) -> None:
    """--compare (a required argparse argument), then the flags of ReportOptions
    (cli/tool_options.py; also SHELLRL_CLI_REPORT_<OPTION>)."""
    from cli.options import add_options
    from cli.tool_options import ReportOptions

    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="DIR",
        required=True,
        help="report directories (<state-dir>/report) or state directories of the runs",
    )
    add_options(parser, ReportOptions)
    parser.set_defaults(_options=ReportOptions)


def run(args) -> int:
    from pathlib import Path

    from cli.compare import write_compare
    from cli.errors import CliError

    try:
        agg = write_compare([Path(d) for d in args.compare], Path(args.out))
    except (OSError, ValueError, KeyError) as exc:
        raise CliError(str(exc)) from None
    for run in agg["runs"]:
        print(f"{run['dir']}: {run['line']}")
    t = agg["target"]
    print(
        f"target met by {t['runs_met']} of {t['runs']} runs; "
        f"compare.md, compare.json, compare.png in {args.out}"
    )
    return 0
