"""The main job: start the stack, evaluate, train with live progress, evaluate again, and write
`<state>/report/` (report.md and PNG plots). What `make run` calls.

    shellrl run [--config shellrl.toml] [--steps 40] [--group-size 8] [--model-path smollm2] ...
    shellrl run --device cuda ...      # engine (bf16) and learner on one GPU
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


def add_arguments(parser) -> None:
    from cli.main_job import JobConfig

    d = JobConfig()
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML file of these options and an [env] table (cli/config_file.py); "
        "flags override it",
    )
    parser.add_argument(
        "--model-path", default=d.model_path, help="smollm2, tiny, or a Hugging Face directory"
    )
    parser.add_argument(
        "--state-dir", default=str(d.state_dir), help="Redis AOF, logs, checkpoints, report"
    )
    add_device_arguments(parser)
    parser.add_argument(
        "--steps", type=int, default=d.steps, help="learner steps (policy versions)"
    )
    parser.add_argument(
        "--time-budget-min",
        type=float,
        default=d.time_budget_s / 60,
        help="training stops after this",
    )
    parser.add_argument(
        "--group-size", type=int, default=d.group_size, help="episodes per GRPO group"
    )
    parser.add_argument(
        "--groups-per-step", type=int, default=d.groups_per_step, help="groups per learner step"
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=d.max_staleness,
        help="policy versions a trajectory may lag the learner",
    )
    parser.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    parser.add_argument(
        "--kl-coef", type=float, default=d.kl_coef, help="k3 KL to the initial policy (0 = off)"
    )
    parser.add_argument(
        "--temperature", type=float, default=d.temperature, help="sampling temperature of training"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=d.max_new_tokens, help="new tokens per turn"
    )
    parser.add_argument(
        "--max-turns", type=int, default=d.max_turns, help="agent turns per episode"
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=d.engine_threads,
        help="torch threads of the engine (0 = torch's default)",
    )
    parser.add_argument(
        "--learner-threads",
        type=int,
        default=d.learner_threads,
        help="torch threads of the learner (0 = torch's default)",
    )
    parser.add_argument(
        "--train-set",
        default=d.train_set,
        help="curriculum, default, generated, a plug-in's task set, or a .jsonl",
    )
    parser.add_argument(
        "--eval-id-episodes",
        type=int,
        default=d.eval_id_episodes,
        help="held-out instances of the training templates",
    )
    parser.add_argument(
        "--eval-ood-episodes",
        type=int,
        default=d.eval_ood_episodes,
        help="instances of templates never trained on",
    )
    parser.add_argument(
        "--agentbench-eval-tasks",
        type=int,
        default=d.agentbench_eval_tasks,
        help="AgentBench training tasks evaluated",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the run: engine sampling (a seed per request), the pool's epoch order, "
        "the learner's RNGs",
    )
    parser.add_argument(
        "--task-seed",
        type=int,
        default=d.task_seed,
        help="seed of the generated training pool and eval sets (keep it to compare runs)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=d.eval_samples,
        help="episodes per eval task (> 1 needs --eval-temperature > 0; estimator: mean pass "
        "rate per task, bootstrap interval over tasks)",
    )
    parser.add_argument(
        "--eval-temperature",
        type=float,
        default=d.eval_temperature,
        help="sampling temperature of the evaluations (0 = greedy, one episode per task)",
    )
    parser.add_argument(
        "--dynamic-sampling",
        action="store_true",
        default=d.dynamic_sampling,
        help="DAPO dynamic sampling: every learner step trains groups with reward variance",
    )
    parser.add_argument(
        "--pass-rate-steering",
        action="store_true",
        default=d.pass_rate_steering,
        help="run fewer groups of templates whose recent training success is 0 or 1",
    )
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
        help="experiment tracking of the evaluations (auto: TensorBoard in <state-dir>/tracking "
        "when installed; W&B runs offline)",
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
        help="with --attach: the learner (SHELLRL_LEARNER_URL, else the gateway's host, port 8103)",
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


def add_device_arguments(parser) -> None:
    """--device and the GPU memory fractions (also `shellrl up`'s)."""
    from cli.stack_config import DEVICES, GPU_MEMORY_FRACTIONS

    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where engine and learner run; cuda: both on one GPU (bf16 engine), each within "
        "its fraction of the GPU's memory (fails at once without a CUDA GPU)",
    )
    for name in ("engine", "learner"):
        parser.add_argument(
            f"--{name}-gpu-memory",
            type=float,
            default=GPU_MEMORY_FRACTIONS[name],
            metavar="FRACTION",
            help=f"with --device cuda: fraction of the GPU's memory the {name} may allocate",
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
    check_device(
        args.device, {"engine": args.engine_gpu_memory, "learner": args.learner_gpu_memory}
    )
    check_model_path(args.model_path)
    cfg = job_config(args)
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

    state = Path(args.state_dir)
    return JobConfig(
        model_path=args.model_path,
        state_dir=state,
        device=args.device,
        engine_gpu_memory=args.engine_gpu_memory,
        learner_gpu_memory=args.learner_gpu_memory,
        steps=args.steps,
        time_budget_s=args.time_budget_min * 60,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        max_staleness=args.max_staleness,
        lr=args.lr,
        kl_coef=args.kl_coef,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        max_turns=args.max_turns,
        train_set=args.train_set,
        eval_id_episodes=args.eval_id_episodes,
        eval_ood_episodes=args.eval_ood_episodes,
        agentbench_eval_tasks=args.agentbench_eval_tasks,
        engine_threads=args.engine_threads,
        learner_threads=args.learner_threads,
        require_command=args.require_command,
        tracker=args.tracker,
        seed=args.seed,
        task_seed=args.task_seed,
        eval_samples=args.eval_samples,
        eval_temperature=args.eval_temperature,
        dynamic_sampling=args.dynamic_sampling,
        pass_rate_steering=args.pass_rate_steering,
    )


def run_attach(args, cfg) -> int:
    """`--attach URL`: the job on the running stack (cli/attached_job.py)."""
    import shutil

    from cli.attached_job import AttachTarget, default_learner_url, run_attached
    from cli.stack_config import api_headers
    from shellrl.clients.transport import auth_headers

    token = args.token or os.environ.get("SHELLRL_API_TOKEN")
    target = AttachTarget(
        rollout_url=args.attach.rstrip("/"),
        learner_url=(args.learner_url or default_learner_url(args.attach)).rstrip("/"),
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
