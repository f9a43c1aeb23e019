"""The dtype a weight push travels in: the engines' own, so the learner ships half the bytes of
its float32 weights to a bfloat16 engine and the engine copies without a cast (slime and verl send
buckets in the engine's dtype).

Consumes the learner's setting (`SHELLRL_WEIGHT_SYNC_DTYPE`: auto, float32, bfloat16, float16),
each engine's /server_info `dtype` (shellrl's engine reports the dtype it serves in; SGLang
reports its `--dtype` argument, often "auto": the checkpoint's `torch_dtype` then, when it is
16-bit) and the checkpoint's config. Produces the torch dtype floating tensors are cast to while
they are copied into the buckets (`WeightStaging.dtype`), or None (sent in the learner's dtype).

Guarantees: never a cast down for an engine that serves float32 or does not say what it serves
(sent in float32, said in the log); one push serves every engine, so engines of different 16-bit
dtypes get float32 under auto (each casts on its side). An engine that serves weights the learner
cannot produce (a dtype other than float32 / bfloat16 / float16, or quantized weights: SGLang's
`quantization` or `modelopt_quant`) is refused (`refusal`), never pushed to: push_setup.py stops
the learner when a configured engine says so at the first push, and keeps one met later out of
rotation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SETTINGS = ("auto", "float32", "bfloat16", "float16")
SIXTEEN_BIT = ("bfloat16", "float16")
# SGLang's --dtype choices (server_args.py) and HF's torch_dtype spellings -> torch's names
_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def canonical(name) -> str | None:
    """torch's name of a dtype named by SGLang, HF or torch ("half" -> "float16"); None for
    "auto", a missing value or anything else."""
    return _NAMES.get(str(name).removeprefix("torch.").lower()) if name else None


# /server_info fields that say an engine's weights are quantized (SGLang 0.5.23 ServerArgs:
# `quantization` (QUANTIZATION_CHOICES, also resolved from a quantized checkpoint's config),
# `modelopt_quant`; `torchao_config` of earlier SGLang releases); "unquant" is SGLang's choice for
# none
QUANTIZED_FIELDS = ("quantization", "modelopt_quant", "torchao_config")
FIX = (
    "serve unquantized weights in bfloat16, float16 or float32: SGLang --dtype bfloat16 (or "
    "auto, float16, float32) without --quantization / --modelopt-quant / --torchao-config; "
    "shellrl's engine SHELLRL_DTYPE=bfloat16"
)


class DtypeRefused(ValueError):
    """An engine serves weights the learner cannot produce (`refusal`); the message names the
    engine, what it reported and the settings that fix it."""


def refusal(url: str, server_info: dict | None) -> str | None:
    """Why the learner cannot push to the engine at `url`, from its /server_info, or None.
    Refused: a `dtype` that is none of SGLang's --dtype spellings ("auto", float32, bfloat16,
    float16 and their aliases; e.g. "int8", "float8_e4m3fn", "fp8"), or a quantization field
    (QUANTIZED_FIELDS) that names a method: the learner pushes float32, bfloat16 or float16
    tensors and has no quantizer. A missing or empty dtype is not refused (float32, said)."""
    info = server_info or {}
    reported = info.get("dtype")
    said = []
    if (
        reported not in (None, "")
        and str(reported).lower() != "auto"
        and canonical(reported) is None
    ):
        said.append(f"dtype {reported!r}")
    said += [
        f"{name} {info[name]!r}"
        for name in QUANTIZED_FIELDS
        if info.get(name) not in (None, "", "unquant", "none", "None")
    ]
    if not said:
        return None
    return (
        f"refused engine {url}: its /server_info reports {' and '.join(said)}, weights the "
        f"learner cannot produce (it pushes float32, bfloat16 or float16 tensors; "
        f"SHELLRL_WEIGHT_SYNC_DTYPE cannot change that); {FIX}"
    )


def checkpoint_dtype(model_dir: str | Path | None) -> str | None:
    """The checkpoint's dtype (`torch_dtype`, or transformers 5's `dtype`, in config.json), or None
    when the directory or the field is missing."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return canonical(config.get("torch_dtype") or config.get("dtype"))


def engine_dtype(server_info: dict | None, checkpoint: str | None) -> str | None:
    """The dtype an engine serves in: its /server_info `dtype` when it names one; "auto" (SGLang's
    default): the checkpoint's when it is 16-bit (SGLang's auto keeps a 16-bit checkpoint's dtype),
    else None (unknown)."""
    reported = (server_info or {}).get("dtype")
    named = canonical(reported)
    if named is not None:
        return named
    if str(reported).lower() == "auto" and checkpoint in SIXTEEN_BIT:
        return checkpoint
    return None


def push_dtype(setting: str, engine_dtypes: dict[str, str | None]) -> tuple[str, str]:
    """(the dtype a push to these engines travels in, why). setting: see SETTINGS (ValueError
    otherwise). float32: never cast. bfloat16 / float16: cast, unless an engine serves float32 or
    does not say (never cast down for it). auto: the engines' dtype when every one serves the same
    16-bit dtype, else float32."""
    if setting not in SETTINGS:
        raise ValueError(f"weight_sync_dtype must be one of {SETTINGS}; got {setting!r}")
    if setting == "float32" or not engine_dtypes:
        return "float32", "the learner's dtype"
    full = sorted(u for u, d in engine_dtypes.items() if d not in SIXTEEN_BIT)
    if full:
        return "float32", f"engines serve float32 or do not say their dtype: {', '.join(full)}"
    if setting != "auto":
        return setting, f"SHELLRL_WEIGHT_SYNC_DTYPE={setting}"
    served = set(engine_dtypes.values())
    if len(served) > 1:
        return "float32", f"engines serve different dtypes ({', '.join(sorted(served))})"
    return served.pop(), "the engines' dtype"


def as_torch(name: str) -> torch.dtype | None:
    """The cast `WeightStaging` takes: None for float32 (the learner's own), else the torch dtype."""
    return None if name == "float32" else getattr(torch, name)
