"""Start the whole stack as local processes (Redis with AOF, engine, sandbox, verifier, rollout,
learner), each after the previous one's /readyz; Ctrl-C (or `shellrl down`) stops it cleanly.

    shellrl up [--model-path smollm2] [--state-dir .shellrl]
"""

from __future__ import annotations

NAME = "up"
HELP = "start the stack as local processes (foreground; Ctrl-C stops it)"


def add_arguments(parser) -> None:
    parser.add_argument("--model-path", default="smollm2", help="smollm2 (default), tiny, or a HF directory")
    parser.add_argument("--state-dir", default=".shellrl", help="Redis AOF, logs, checkpoints, reports")
    parser.add_argument("--quiet", action="store_true", help="do not echo service logs (they stay in <state>/logs)")


def run(args) -> int:
    from pathlib import Path

    from cli.launcher import StackConfig, up

    state = Path(args.state_dir)
    config = StackConfig(state_dir=state, model_path=args.model_path, echo_logs=not args.quiet,
                         env={"SHELLRL_CHECKPOINT_DIR": str((state / "checkpoints").resolve())})
    return up(config)
