"""Evaluate a policy on the main job's fixed eval sets (or a task file) and print each set's
success with its 95% interval and a per-template table: the running stack's current policy at
`--url`, or, with `--model-path DIR`, a model (a checkpoint, `shellrl export`'s output) on a stack
this command starts without a learner (Redis, engine, sandbox, verifier, rollout, with the main
job's recipe, cli/recipe.py: its turns and tokens per turn; state under `--state-dir`, deleted
first, refused when it holds a training run's checkpoints) and stops when done.

    shellrl eval [--url http://127.0.0.1:8100 | --model-path DIR [--state-dir .shellrl-eval]
                 [--device cpu]] [--port-offset N] [--sets eval_id,eval_ood,seeds,agentbench]
                 [--tasks FILE.jsonl] [--episodes K] [--temperature T] [--out results.json]

The sets are the ones `shellrl run` evaluates before and after training (cli/main_job.py
`eval_sets`, default JobConfig: the same task seed, so the same instances); `--tasks` evaluates one
JSONL task file instead (set name: the file's stem). Tasks are submitted as `eval` copies (never
added to the training pool), then evaluated through the gateway (`POST /v1/evaluations`, as the
main job: cli/job_evaluations.py): greedy with one episode per task at temperature 0, else
`--episodes` seeded samples per task. The gateway's token is sent as by `shellrl submit` (the
started stack's own token with `--model-path`). Exit status: 0 done, 1 the started stack fails
to start (the service and its log's last error named), 2 the gateway cannot be reached or
refuses the tasks, or a bad `--model-path` (one line, before anything starts).
"""

from __future__ import annotations

from pathlib import Path

from cli.errors import CliError, http_errors

NAME = "eval"
HELP = (
    "evaluate a policy (the running stack's, or --model-path DIR on a stack it starts) on the "
    "fixed eval sets; per-template tables"
)


def add_arguments(parser) -> None:
    """The flags of EvalOptions (cli/command_options.py; also SHELLRL_CLI_EVAL_<OPTION>)."""
    from cli.command_options import EvalOptions
    from cli.options import add_options

    add_options(parser, EvalOptions)
    parser.set_defaults(_options=EvalOptions)


def load_sets(names: str, tasks_file: Path | None) -> dict[str, list]:
    """{set name: [Task]}: the file's tasks, or the named sets of the main job. Raises CliError
    for an unknown set name or a task file that cannot be read or parsed."""
    from cli.command_options import EVAL_SETS as SETS
    from shellrl.contract import iter_tasks_jsonl

    if tasks_file is not None:
        try:
            with tasks_file.open() as f:
                return {tasks_file.stem: list(iter_tasks_jsonl(f, default_split="eval"))}
        except (OSError, ValueError) as exc:
            raise CliError(f"{tasks_file}: {exc}") from None
    wanted = [s.strip() for s in names.split(",") if s.strip()]
    if unknown := [s for s in wanted if s not in SETS]:
        raise CliError(f"--sets: unknown set(s) {', '.join(unknown)}; choose from {SETS}")
    from cli.job_config import JobConfig
    from cli.job_tasks import eval_sets

    sets = eval_sets(JobConfig())
    return {name: sets[name] for name in wanted}


def template_rows(view: dict, tasks_by_id: dict) -> list[tuple[str, int, int, int, float]]:
    """[(template, tasks, successes, scored episodes, success rate)] of an evaluation view, by
    template name; the rate is the mean of the tasks' pass rates (cli/eval_stats.py). Episodes
    that failed for infrastructure are not scored and count nowhere."""
    from cli.eval_stats import task_outcomes, template_of

    per: dict[str, list] = {}
    for task_id, (successes, n) in task_outcomes(view).items():
        if n:
            row = per.setdefault(template_of(task_id, tasks_by_id), [0, 0, 0, 0.0])
            row[0] += 1
            row[1] += successes
            row[2] += n
            row[3] += successes / n
    return [(t, k, s, n, rates / k) for t, (k, s, n, rates) in sorted(per.items())]


def render(name: str, view: dict, tasks_by_id: dict):
    """rich renderables: the set's success with n and its 95% interval (one line), then a table
    with a row per template."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from cli.eval_stats import set_score

    score = set_score(view)
    line = Text(
        f"{name}: success {score.rate:.3f} [{score.low:.3f}, {score.high:.3f}] "
        f"(n={score.tasks} tasks, {score.episodes} episodes, {score.estimator}; "
        f"policy versions {view.get('policy_versions_seen')})",
        style="bold",
    )
    table = Table()
    for column in ("template", "tasks", "successes", "episodes", "success rate"):
        table.add_column(column, justify="left" if column == "template" else "right")
    for template, k, s, n, rate in template_rows(view, tasks_by_id):
        table.add_row(template, str(k), str(s), str(n), f"{rate:.3f}")
    return Group(line, table)


def run(args) -> int:
    from cli.stack_config import API_TOKEN_FILE, api_headers, shifted_ports

    sets = load_sets(args.sets, args.tasks)
    ports = shifted_ports(args.port_offset)
    if args.model_path is None:
        url = args.url or f"http://127.0.0.1:{ports['rollout']}"
        state = Path(args.state_dir)
        given = [state] if (state / API_TOKEN_FILE).exists() else []  # else the default's
        return evaluate_sets(args, sets, url, api_headers(*given))
    import shutil

    from cli.launcher import Stack
    from cli.model_path import check_model_path
    from cli.recipe import Recipe
    from cli.stack_config import SERVICE_ORDER, StackConfig, check_device

    check_model_path(args.model_path)
    check_device(args.device, None, "colocated")  # the engine only
    state = Path(args.state_dir)
    checkpoints = state / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise CliError(
            f"--state-dir {state}: holds a training run's checkpoints; give a directory of its "
            "own (it is deleted first)"
        )
    shutil.rmtree(state, ignore_errors=True)
    recipe = Recipe()  # the turns, tokens and require_command of `shellrl run`'s evaluations
    config = StackConfig(
        state_dir=state,
        model_path=args.model_path,
        device=args.device,
        echo_logs=False,
        env=recipe.env(),
        service_env=recipe.service_env(),
        ports=ports,
        services=tuple(s for s in SERVICE_ORDER if s != "learner"),  # nothing trains
    )
    with Stack(config) as stack:
        return evaluate_sets(args, sets, stack.config.url("rollout"), config.auth_headers())


def evaluate_sets(args, sets: dict[str, list], url: str, headers: dict[str, str]) -> int:
    """Submit `sets` as eval copies to the gateway at `url`, evaluate them, print the results
    (and write them to args.out). Raises CliError when the gateway cannot be reached."""
    import json

    import httpx

    from cli.console import cli_console
    from cli.job_evaluations import evaluate
    from cli.job_stack import submit

    tasks_by_id, id_sets = {}, {}
    client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60)
    with client, http_errors(f"cannot reach the rollout gateway at {url}"):
        for name, tasks in sets.items():
            ids = submit(client, tasks, eval_copy=True)
            tasks_by_id.update(zip(ids, tasks, strict=True))
            id_sets[name] = ids
        results = evaluate(client, id_sets, "now", args.episodes, args.temperature)
    console = cli_console()
    for name, view in results.items():
        console.print(render(name, view, tasks_by_id))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
        console.print(f"wrote {args.out}")
    return 0
