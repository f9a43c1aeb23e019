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
# Each shows the field's default; a `bool` is a switch that turns it on.
JOB_OPTIONS = (
    ("steps", int, "learner steps (policy versions)"),
    ("group_size", int, "episodes per GRPO group"),
    ("groups_per_step", int, "groups per learner step"),
    ("max_staleness", int, "policy versions a trajectory may lag the learner"),
    ("lr", float, "peak AdamW learning rate"),
    ("kl_coef", float, "k3 KL to the initial policy (0 = off)"),
    ("temperature", float, "sampling temperature of training"),
    ("max_new_tokens", int, "new tokens per turn"),
    ("max_turns", int, "agent turns per episode"),
    ("engine_threads", int, "torch threads of the engine (0 = torch's default)"),
    ("learner_threads", int, "torch threads of the learner (0 = torch's default)"),
    ("train_set", None, "curriculum, default, generated, a plug-in's task set, or a .jsonl"),
    ("eval_id_episodes", int, "held-out instances of the training templates"),
    ("eval_ood_episodes", int, "instances of templates never trained on"),
    ("agentbench_eval_tasks", int, "AgentBench training tasks evaluated"),
    (
        "seed",
        int,
        "seed of the run: engine sampling (a seed per request), the pool's epoch order, "
        "the learner's RNGs",
    ),
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
    (
        "dynamic_sampling",
        bool,
        "DAPO dynamic sampling: every learner step trains groups with reward variance",
    ),
    (
        "pass_rate_steering",
        bool,
        "run fewer groups of templates whose recent training success is 0 or 1",
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
        flag, default = "--" + name.replace("_", "-"), getattr(d, name)
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument(
        "--no-require-command",
        dest="require_command",
        action="store_false",
        help="train on successes that ran no command too (guesses get amplified); "
        "the default is require_command",
    )
    parser.add_argument(
        "--tracker",
        choices=("auto", "none", "tensorboard", "wandb", "mlflow"),
        default=d.tracker,
        help="experiment tracking of the learner's steps, sampled episodes and settings and of "
        "the job's evaluations and options (auto: TensorBoard in <state-dir>/tracking when "
        "installed; W&B runs offline)",
    )
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
    from shellrl.tracking import PACKAGES, installed

    if args.eval_samples < 1 or (args.eval_samples > 1 and args.eval_temperature <= 0):
        raise CliError("--eval-samples > 1 needs --eval-temperature > 0 (greedy repeats itself)")
    if args.tracker in PACKAGES and not installed(args.tracker):
        raise CliError(f"--tracker {args.tracker}: pip install {PACKAGES[args.tracker]}")
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
    from pathlib import Path

    from cli.main_job import JobConfig

    return JobConfig(
        model_path=args.model_path,
        state_dir=Path(args.state_dir),
        device=args.device,
        engine_gpu_memory=args.engine_gpu_memory,
        learner_gpu_memory=args.learner_gpu_memory,
        port_offset=args.port_offset,
        time_budget_s=args.time_budget_min * 60,
        require_command=args.require_command,
        tracker=args.tracker,
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
