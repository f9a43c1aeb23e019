"""Write a learner checkpoint as a servable Hugging Face model directory (config, generation
config, tokenizer, safetensors; no optimizer or RNG state), for `transformers`, SGLang, vLLM or
`shellrl run --model-path DIR`.

    shellrl export .shellrl/checkpoints/step-000040 out/policy-v40 [--dtype bfloat16]

A checkpoint written before checkpoints carried the tokenizer needs `--tokenizer-from MODEL`
(smollm2, tiny or a model directory: the base model it was trained from). The directory is
world-readable (files 0644, directories 0755: shellrl/files.py).
"""

from __future__ import annotations

NAME = "export"
HELP = "write a learner checkpoint as a servable Hugging Face directory"


def add_arguments(parser) -> None:
    """CHECKPOINT and OUT, then the flags of ExportOptions (cli/tool_options.py; also
    SHELLRL_CLI_EXPORT_<OPTION>)."""
    from cli.options import add_options
    from cli.tool_options import ExportOptions

    parser.add_argument("checkpoint", help="a checkpoint directory (<checkpoint_dir>/step-NNNNNN)")
    parser.add_argument("out", help="the directory to write (must not exist, or be empty)")
    add_options(parser, ExportOptions)
    parser.set_defaults(_options=ExportOptions)


def run(args) -> int:
    from pathlib import Path

    from cli.errors import CliError
    from cli.model_path import check_model_path
    from services.learner.servable import export_checkpoint
    from shellrl.files import share_readable
    from shellrl.models import resolve_model_path

    tokenizer_from = None
    if args.tokenizer_from:
        try:
            tokenizer_from = resolve_model_path(args.tokenizer_from)
        except FileNotFoundError as exc:
            raise CliError(f"--tokenizer-from {args.tokenizer_from}: {exc}") from None
    try:
        out = export_checkpoint(
            Path(args.checkpoint), Path(args.out), dtype=args.dtype, tokenizer_from=tokenizer_from
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    share_readable(out)  # for a server that runs as another user (safetensors writes 0600)
    check_model_path(str(out))
    print(f"exported {args.checkpoint} -> {out} (dtype {args.dtype or 'as trained'})")
    return 0
