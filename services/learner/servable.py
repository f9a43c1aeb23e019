"""Servable model directories: what every learner checkpoint holds besides the training state, and
what `shellrl export` writes.

A servable directory is a complete Hugging Face model directory:
  config.json               the architecture, with `dtype` = the dtype of the weights
  generation_config.json    the model's generation defaults (eos/bos/pad ids)
  model.safetensors         the weights (or model-0000i-of-0000n.safetensors and
                            model.safetensors.index.json)
  tokenizer files           tokenizer.json, tokenizer_config.json, chat_template.jinja, ... copied
                            byte for byte from the directory the policy was loaded from
so `transformers.AutoModelForCausalLM.from_pretrained(dir)`, `AutoTokenizer.from_pretrained(dir)`,
`python -m services.engine --model-path dir`, SGLang and vLLM load it as they load the base model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
TRAINING_STATE_FILES = ("trainer.pt", "rng.pt", "state.json")  # checkpoint.py: not needed to serve
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_dir(model: torch.nn.Module) -> Path | None:
    """The directory `model` was loaded from (`from_pretrained` records it), or None."""
    name = getattr(model, "name_or_path", "") or getattr(
        getattr(model, "config", None), "_name_or_path", ""
    )
    path = Path(name) if name else None
    return path if path is not None and path.is_dir() else None


def has_tokenizer(directory: Path) -> bool:
    return any(
        (directory / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")
    )


def copy_tokenizer(source: Path, directory: Path) -> list[str]:
    """Copy the tokenizer files of `source` into `directory`; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)
            copied.append(name)
    return copied


def write_servable(
    model: torch.nn.Module,
    directory: Path,
    source: Path | None = None,
    state_dict: dict | None = None,
) -> None:
    """Write `model` into `directory` as a servable directory (module docstring), weights in the
    dtype of its parameters (the training dtype). source: where the tokenizer and, when the model
    has none, generation_config.json come from (default: the directory the model was loaded from);
    without one the directory has weights and config only. state_dict: the weights to write
    instead of the model's own (a sharded model's, gathered whole: Trainer.full_state_dict)."""
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    source = source or source_dir(model)
    if source is None:
        return
    copy_tokenizer(source, directory)
    if (
        not (directory / "generation_config.json").exists()
        and (source / "generation_config.json").exists()
    ):
        shutil.copy2(source / "generation_config.json", directory / "generation_config.json")


def export_checkpoint(
    checkpoint: Path, out: Path, *, dtype: str | None = None, tokenizer_from: Path | None = None
) -> Path:
    """Write the servable part of a learner checkpoint (`step-N/`) into `out` (created; must not
    exist or be empty): config, generation config, tokenizer, safetensors, none of the training
    state. dtype: "float32", "bfloat16" or "float16" to cast the floating-point weights (None = as
    trained). tokenizer_from: a model directory whose tokenizer files to copy when the checkpoint
    has none (checkpoints written before they carried one).

    Raises ValueError when `checkpoint` has no config.json or no safetensors, when no tokenizer is
    found, for an unknown dtype, or when `out` is a non-empty directory. The directory appears
    complete or not at all (written under a temporary name, then renamed)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if not (checkpoint / "config.json").is_file():
        raise ValueError(
            f"{checkpoint}: no config.json (not a learner checkpoint or model directory)"
        )
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{checkpoint}: no *.safetensors weights")
    tokenizer_source = checkpoint if has_tokenizer(checkpoint) else tokenizer_from
    if tokenizer_source is None or not has_tokenizer(Path(tokenizer_source)):
        raise ValueError(
            f"{checkpoint}: no tokenizer; name the base model's directory to copy it from"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for path in sorted(checkpoint.iterdir()):
            if (
                path.name in TRAINING_STATE_FILES
                or not path.is_file()
                or path.suffix == ".safetensors"
            ):
                continue
            shutil.copy2(path, tmp / path.name)
        copy_tokenizer(Path(tokenizer_source), tmp)
        for path in weights:
            _copy_weights(path, tmp / path.name, DTYPES[dtype] if dtype else None)
        if dtype is not None:
            _retotal_index(tmp)
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = dtype
            config.pop("torch_dtype", None)
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _copy_weights(src: Path, dst: Path, dtype: torch.dtype | None) -> None:
    if dtype is None:
        shutil.copy2(src, dst)
        return
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v) for k, v in load_file(str(src)).items()
    }
    save_file(tensors, str(dst), metadata={"format": "pt"})


def _retotal_index(directory: Path) -> None:
    """Sharded weights: the index's `total_size` (bytes) after a cast."""
    index_path = directory / "model.safetensors.index.json"
    if not index_path.exists():
        return
    index = json.loads(index_path.read_text())
    total = 0
    for name in sorted(set(index.get("weight_map", {}).values())):
        total += sum(
            t.numel() * t.element_size() for t in load_file(str(directory / name)).values()
        )
    index.setdefault("metadata", {})["total_size"] = total
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
