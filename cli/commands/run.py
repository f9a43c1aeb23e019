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


# The job's own options (JobConfig's fields beyond the recipe's): RunOptions, cli/options.py.
JOB_OPTIONS = (
    "steps",
    "train_set",
    "eval_id_episodes",
    "eval_ood_episodes",
    "agentbench_eval_tasks",
    "task_seed",
    "eval_samples",
    "eval_temperature",
    "eval_every_steps",
    "eval_kl",
)


def add_arguments(parser) -> None:
    from cli.options import RunOptions, add_options

    add_options(parser, RunOptions)
    parser.set_defaults(_options=RunOptions)


def run(args) -> int:
    import shutil

    from cli.errors import CliError
    from cli.main_job import run_job
    from cli.model_path import check_model_path
    from cli.stack_config import check_device
    from cli.stack_options import check_tracker

    if args.eval_samples < 1 or (args.eval_samples > 1 and args.eval_temperature <= 0):
        raise CliError("--eval-samples > 1 needs --eval-temperature > 0 (greedy repeats itself)")
    if args.eval_every_steps < 0:
        raise CliError("--eval-every-steps must be >= 0 (0: no evaluation during training)")
    if args.attach and (args.eval_every_steps or args.eval_kl):
        raise CliError("--eval-every-steps and --eval-kl are not supported with --attach (yet)")
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

    from cli.job_config import JobConfig
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
        **{name: getattr(args, name) for name in JOB_OPTIONS},
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
