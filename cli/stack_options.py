"""The options of every command that starts the stack (`shellrl run`, `shellrl up`): the config
file, the model, the state directory, where engine and learner run, the tracker and the recipe
(cli/recipe.py). One definition, so both commands (and a config file read for either,
cli/config_file.py) take the same names, defaults and help texts."""

from __future__ import annotations


def add_stack_arguments(parser) -> None:
    """--config, --model-path, --state-dir (JobConfig's defaults), --port-offset, --device, the
    engine's and learner's GPU memory fractions, --tracker and the recipe's options."""
    from cli.main_job import JobConfig
    from cli.recipe import add_recipe_arguments
    from cli.stack_config import DEVICES, GPU_LAYOUTS, GPU_MEMORY_FRACTIONS
    from shellrl.tracking import BACKENDS

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
    add_port_offset_argument(parser)
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where engine and learner run; cuda: on one GPU they share or two GPUs, one each "
        "(--gpu-layout; bf16 engine), each within its fraction of its GPU's memory (fails at "
        "once without a CUDA GPU)",
    )
    parser.add_argument(
        "--gpu-layout",
        choices=GPU_LAYOUTS,
        default="auto",
        help="with --device cuda: colocated (engine and learner share the first GPU), split "
        "(engine on the first GPU, learner on the second), auto (split when two or more GPUs "
        "are visible)",
    )
    for name in ("engine", "learner"):
        parser.add_argument(
            f"--{name}-gpu-memory",
            type=float,
            default=GPU_MEMORY_FRACTIONS[name],
            metavar="FRACTION",
            help=f"with --device cuda: fraction of its GPU's memory the {name} may allocate",
        )
    parser.add_argument(
        "--tracker",
        choices=BACKENDS,
        default=d.tracker,
        help="experiment tracking of the learner's steps, sampled episodes and settings (and of "
        "`run`'s evaluations and options): auto = TensorBoard in <state-dir>/tracking when "
        "installed; W&B runs offline",
    )
    add_recipe_arguments(parser)


def check_tracker(tracker: str) -> None:
    """Raise CliError (before anything starts) when `tracker`'s package is not installed."""
    from cli.errors import CliError
    from shellrl.tracking import PACKAGES, installed

    if tracker in PACKAGES and not installed(tracker):
        raise CliError(f"--tracker {tracker}: pip install {PACKAGES[tracker]}")


def add_port_offset_argument(parser) -> None:
    """--port-offset: every port of the stack (Redis and each service) moved by N."""
    from cli.stack_config import default_ports_text

    parser.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="N",
        help="move every port of the stack by N, so that a second stack can run beside the "
        f"first (with a --state-dir of its own); the default ports: {default_ports_text()}",
    )
