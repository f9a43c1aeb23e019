"""Start the whole stack as local processes (Redis with AOF, engine, sandbox, verifier, rollout,
learner), each after the previous one's /readyz; Ctrl-C (or `shellrl down`) stops it cleanly.

    shellrl up [--config shellrl.toml] [--model-path smollm2] [--state-dir .shellrl] [--device cuda]
    shellrl up --port-offset 1000 --state-dir .shellrl-b    # a second stack beside the first
"""

from __future__ import annotations

from cli.stack_options import add_stack_arguments

NAME = "up"
HELP = "start the stack as local processes (foreground; Ctrl-C stops it)"


def add_arguments(parser) -> None:
    add_stack_arguments(parser)
    parser.add_argument(
        "--quiet", action="store_true", help="do not echo service logs (they stay in <state>/logs)"
    )


def run(args) -> int:
    from cli.launcher import up

    return up(stack_config(args))


def stack_config(args):
    """The StackConfig of the parsed options. Raises CliError (before anything starts) for a
    device that cannot run here, a bad model path or a port offset out of range."""
    from pathlib import Path

    from cli.model_path import check_model_path
    from cli.stack_config import StackConfig, check_device, shifted_ports

    gpu_memory = {"engine": args.engine_gpu_memory, "learner": args.learner_gpu_memory}
    layout = check_device(args.device, gpu_memory, args.gpu_layout)
    check_model_path(args.model_path)
    state = Path(args.state_dir)
    env = {
        "SHELLRL_CHECKPOINT_DIR": str((state / "checkpoints").resolve()),
        **(getattr(args, "config_env", None) or {}),
    }
    return StackConfig(
        state_dir=state,
        model_path=args.model_path,
        echo_logs=not args.quiet,
        env=env,
        device=args.device,
        gpu_memory=gpu_memory,
        gpu_layout=layout,
        ports=shifted_ports(args.port_offset),
    )
