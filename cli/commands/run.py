"""The main job: start the stack, evaluate, train with live progress, evaluate again, and write
`<state>/report/` (report.md and PNG plots). What `make run` calls.

    shellrl run [--config shellrl.toml] [--steps 40] [--group-size 8] [--model-path smollm2] ...
    shellrl run --device cuda ...      # engine (bf16) and learner on one GPU (two: one each,
                                       # --gpu-layout)
    shellrl run --seed 1 --dynamic-sampling --pass-rate-steering --groups-per-step 2
    shellrl run --eval-samples 4 --eval-temperature 0.7   # 4 sampled episodes per eval task

    shellrl run --attach http://127.0.0.1:8100 --token "$(cat secrets/api_token)" --steps 20
                                       # a running stack (compose, k8s): no start, no stop

The report's summary.json and the job's last line say whether the run met the target; compare
runs with `shellrl report --compare DIR...`. With `--attach URL` the job drives a stack that is
already running (cli/attached_job.py): it evaluates, submits the train set with `POST /v1/runs`,
follows the run, evaluates again and writes the report; the stack's own settings apply (group
size, learning rate, staleness, temperature ...), the options that configure a stack are ignored.
"""

from __future__ import annotations

import os

NAME = "run"
HELP = "the main job: stack up, eval, train, eval, report (what `make run` calls)"


# The options that set the JobConfig field of their name, in --help's order: (field, type, help).
# Each shows the field's default. The recipe's options (--lr, --kl-coef, --temperature ...) are
# `shellrl up`'s too: cli/recipe.py, added with the stack's (cli/stack_options.py).
JOB_OPTIONS = (
    ("steps", int, "learner steps (policy versions)"),
    ("train_set", None, "curriculum, default, generated, a plug-in's task set, or a .jsonl"),
    ("eval_id_episodes", int, "held-out instances of the training templates"),
    ("eval_ood_episodes", int, "instances of templates never trained on"),
    ("agentbench_eval_tasks", int, "AgentBench training tasks evaluated"),
    (
        "task_seed",
        int,
        "seed of the generated training pool and eval sets (keep it to compare runs)",
    ),
    (
        "eval_samples",
        int,
        "episodes per eval task (> 1 needs --eval-temperature > 0; estimator: mean pass "
        "rate per task, bootstrap interval over tasks)",
    ),
    (
        "eval_temperature",
        float,
        "sampling temperature of the evaluations (0 = greedy, one episode per task)",
    ),
)


def add_arguments(parser) -> None:
    from cli.main_job import JobConfig
    from cli.stack_options import add_stack_arguments

    d = JobConfig()
    add_stack_arguments(parser)
    parser.add_argument(
        "--time-budget-min",
        type=float,
        default=d.time_budget_s / 60,
        help="training stops after this",
    )
    for name, kind, help_text in JOB_OPTIONS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=getattr(d, name), help=help_text)
    parser.add_argument(
        "--fresh", action="store_true", help="delete <state-dir> first (Redis, checkpoints, logs)"
    )
    add_attach_arguments(parser)


def add_attach_arguments(parser) -> None:
    """--attach and the running stack's other URLs and token."""
    parser.add_argument(
        "--attach",
        metavar="URL",
        default=None,
        help="drive the stack running at this rollout gateway URL (compose, k8s) instead of "
        "starting one; the report goes to <state-dir>/report",
    )
    parser.add_argument(
        "--learner-url",
        default=os.environ.get("SHELLRL_LEARNER_URL"),
        help="with --attach: the learner (SHELLRL_LEARNER_URL, else the gateway's host, port "
        "8103 + --port-offset)",
    )
    parser.add_argument(
        "--verifier-url",
        default=None,
        help="with --attach: the verifier, to check its require_command (compose publishes none)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="with --attach: the stack's bearer token (else SHELLRL_API_TOKEN, "
        "SHELLRL_API_TOKEN_FILE or <state-dir>/api_token)",
    )


def run(args) -> int:
    import shutil

    from cli.errors import CliError
    from cli.main_job import run_job
    from cli.model_path import check_model_path
    from cli.stack_config import check_device
    from cli.stack_options import check_tracker

    if args.eval_samples < 1 or (args.eval_samples > 1 and args.eval_temperature <= 0):
        raise CliError("--eval-samples > 1 needs --eval-temperature > 0 (greedy repeats itself)")
    check_tracker(args.tracker)
    if args.attach:
        return run_attach(args, job_config(args))
    layout = check_device(
        args.device,
        {"engine": args.engine_gpu_memory, "learner": args.learner_gpu_memory},
        args.gpu_layout,
    )
    check_model_path(args.model_path)
    cfg = job_config(args)
    cfg.gpu_layout = layout
    env = getattr(args, "config_env", None) or {}
    if taken := sorted(set(env) & cfg.managed_env()):
        raise CliError(
            f"config file {args.config}: [env] {', '.join(taken)}: set by the job from its "
            "options; use the option instead"
        )
    cfg.extra_env = dict(env)
    if args.fresh and cfg.state_dir.exists():
        shutil.rmtree(cfg.state_dir)
    try:
        run_job(cfg)
    except KeyboardInterrupt:  # the Stack context manager has stopped every process by now
        print("interrupted: the stack is stopped; logs and checkpoints stay in", cfg.state_dir)
        return 130
    return 0


def job_config(args):
    """The JobConfig of the parsed options."""
    from dataclasses import asdict
    from pathlib import Path

    from cli.main_job import JobConfig
    from cli.recipe import recipe_from_args

    return JobConfig(
        model_path=args.model_path,
        state_dir=Path(args.state_dir),
        device=args.device,
        engine_gpu_memory=args.engine_gpu_memory,
        learner_gpu_memory=args.learner_gpu_memory,
        port_offset=args.port_offset,
        time_budget_s=args.time_budget_min * 60,
        tracker=args.tracker,
        **asdict(recipe_from_args(args)),
        **{name: getattr(args, name) for name, _, _ in JOB_OPTIONS},
    )


def run_attach(args, cfg) -> int:
    """`--attach URL`: the job on the running stack (cli/attached_job.py)."""
    import shutil

    from cli.attached_job import AttachTarget, default_learner_url, run_attached
    from cli.stack_config import api_headers
    from shellrl.clients.transport import auth_headers

    token = args.token or os.environ.get("SHELLRL_API_TOKEN")
    learner_url = args.learner_url or default_learner_url(args.attach, args.port_offset)
    target = AttachTarget(
        rollout_url=args.attach.rstrip("/"),
        learner_url=learner_url.rstrip("/"),
        headers=auth_headers(token) if token else api_headers(cfg.state_dir),
        verifier_url=args.verifier_url,
    )
    if args.fresh and cfg.state_dir.exists():
        shutil.rmtree(cfg.state_dir / "report", ignore_errors=True)
        shutil.rmtree(cfg.state_dir / "tracking", ignore_errors=True)
    try:
        run_attached(cfg, target)
    except KeyboardInterrupt:
        print("interrupted: the run is stopped; the stack keeps running")
        return 130
    return 0
