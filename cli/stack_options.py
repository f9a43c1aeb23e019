"""The options of every command that starts the stack (`shellrl run`, `shellrl up`): the config
file, the model, the state directory, and where engine and learner run. One definition, so both
commands (and a config file read for either, cli/config_file.py) take the same names, defaults
and help texts."""

from __future__ import annotations


def add_stack_arguments(parser) -> None:
    """--config, --model-path, --state-dir (JobConfig's defaults), --port-offset, --device and the
    engine's and learner's GPU memory fractions."""
    from cli.main_job import JobConfig
    from cli.stack_config import DEVICES, GPU_LAYOUTS, GPU_MEMORY_FRACTIONS

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
