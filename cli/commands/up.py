"""Start the whole stack as local processes (Redis with AOF, engine, sandbox, verifier, rollout,
learner), each after the previous one's /readyz; Ctrl-C (or `shellrl down`) stops it cleanly.

    shellrl up [--config shellrl.toml] [--model-path smollm2] [--state-dir .shellrl] [--device cuda]
    shellrl up --port-offset 1000 --state-dir .shellrl-b    # a second stack beside the first
    shellrl up --kl-coef 0 --temperature 1.0                # the recipe's options, as `run`'s

The services run the main job's recipe (cli/recipe.py: KL, learning rate, temperature, turns,
require_command ... as `shellrl run` starts them), so `POST /v1/runs` and `shellrl run --attach`
on this stack train as `shellrl run` does. Unlike `run`, the learner starts training at once
(not paused) and has no step limit.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cli.stack_config import StackConfig

NAME = "up"
HELP = "start the stack as local processes (foreground; Ctrl-C stops it)"


def add_arguments(parser) -> None:
    from cli.options import UpOptions, add_options

    add_options(parser, UpOptions)
    parser.set_defaults(_options=UpOptions)


def run(args) -> int:
    return up(stack_config(args))


def up(config: StackConfig) -> int:
    """Foreground: start everything, print the URLs, wait for Ctrl-C or `shellrl down`. A
    process that exits stops the stack: one line on stderr names it with its exit status, failure
    class, log and the log's last error (as `shellrl run` reports it), and up returns 1."""
    from cli.launcher import Stack
    from cli.stack_failure import ServiceExited

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Stack(config) as stack:
        print(
            f"shellrl is up ({config.device}): rollout {config.url('rollout')}  "
            f"redis {config.redis_url}  logs {stack.log_dir}/",
            flush=True,
        )
        while not stop.is_set():
            try:
                stack.raise_if_exited()
            except ServiceExited as exc:  # its status, failure class, log and last error
                last = f" (last error: {exc.cause})" if exc.cause else ""
                print(
                    f"{exc.service} exited with status {exc.status}: {exc.failure_class}; see "
                    f"{exc.log_path}{last}; shutting the stack down",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            stop.wait(1.0)
        print("shutting down…", flush=True)
    return 0


def stack_config(args):
    """The StackConfig of the parsed options. Raises CliError (before anything starts) for a
    device that cannot run here, a bad model path, a port offset out of range, a tracker not
    installed or an [env] name the recipe or the launcher sets."""
    from pathlib import Path

    from cli.errors import CliError
    from cli.model_path import check_model_path
    from cli.recipe import recipe_from_args
    from cli.stack_config import StackConfig, check_device, launcher_names, shifted_ports
    from cli.stack_options import check_tracker

    gpu_memory = {"engine": args.engine_gpu_memory, "learner": args.learner_gpu_memory}
    layout = check_device(args.device, gpu_memory, args.gpu_layout)
    check_model_path(args.model_path)
    check_tracker(args.tracker)
    state = Path(args.state_dir)
    recipe = recipe_from_args(args)
    service_env = recipe.service_env()
    service_env["learner"]["SHELLRL_TRACKER"] = args.tracker
    config = StackConfig(
        state_dir=state,
        model_path=args.model_path,
        echo_logs=not args.quiet,
        env={"SHELLRL_CHECKPOINT_DIR": str((state / "checkpoints").resolve()), **recipe.env()},
        service_env=service_env,
        device=args.device,
        gpu_memory=gpu_memory,
        gpu_layout=layout,
        ports=shifted_ports(args.port_offset),
    )
    env = getattr(args, "config_env", None) or {}
    if taken := sorted(set(env) & launcher_names(config)):
        raise CliError(
            f"config file {args.config}: [env] {', '.join(taken)}: set by `shellrl up` from its "
            "options (the recipe's: cli/recipe.py); use the option instead"
        )
    config.env |= env
    return config
