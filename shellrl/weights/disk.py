"""The disk weight transport: one safetensors file in a directory that the engines can read.

The learner writes a version with `save_safetensors_dir` and names the directory in
`/update_weights_from_disk`; the engine reads it back with `load_safetensors_dir`. Used when an
engine is on another host (no shared memory, no CUDA IPC); the in-memory transports are in
`shellrl.weights.shm` (shared memory) and `shellrl.weights.gpu` (CUDA IPC, pinned host).
torch and safetensors are imported on first use: shellrl's shared library keeps torch out of
import time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def save_safetensors_dir(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    directory: str | Path,
    filename: str = "model.safetensors",
) -> Path:
    """Write the tensors as one safetensors file in `directory` (created); returns the file path.
    Written to a temporary name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / filename
    tmp = directory / f".{filename}.tmp-{os.getpid()}"
    save_file(
        {n: t.detach().contiguous().cpu() for n, t in named_tensors},
        str(tmp),
        metadata={"format": "pt"},
    )
    os.replace(tmp, target)
    return target


def load_safetensors_dir(directory: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of every `*.safetensors` file in `directory`, on CPU.
    Raises FileNotFoundError when there is none."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    out: list = []
    for path in files:
        out.extend(load_file(str(path)).items())
    return out
