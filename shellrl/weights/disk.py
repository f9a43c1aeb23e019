"""The disk weight transport: one safetensors file in a directory that the engines can read.

The learner writes a version with `save_safetensors_dir` (or, sharded, `save_safetensors_stream`:
one gathered parameter at a time) and names the directory in `/update_weights_from_disk`; the
engine reads it back with `load_safetensors_dir`. Used when an engine is on another host (no
shared memory, no CUDA IPC); the in-memory transports are in
`shellrl.weights.shm` (shared memory) and `shellrl.weights.gpu` (CUDA IPC, pinned host).
torch and safetensors are imported on first use: shellrl's shared library keeps torch out of
import time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from shellrl.files import FILE_MODE

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
    os.chmod(tmp, FILE_MODE)  # safetensors writes 0600: an engine of another user must read it
    os.replace(tmp, target)
    return target


SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def save_safetensors_stream(
    layout: list[tuple[str, torch.Tensor]],
    values: Iterator[tuple[str, torch.Tensor]],
    directory: str | Path,
    filename: str = "model.safetensors",
) -> Path:
    """Like `save_safetensors_dir`, but the tensors come one at a time from `values` (an iterator
    of (name, tensor) in `layout`'s order) and each is written and dropped before the next is
    made: the sharded learner's push, which gathers one parameter at a time. layout: (name, meta
    tensor) per tensor (`bucket.describe`), which fixes the header before any data is at hand.

    The file is the safetensors format (https://github.com/huggingface/safetensors: 8-byte
    little-endian header size, JSON header padded with spaces to 8 bytes, then the data), with
    the data ordered by element size, largest first, as `safetensors.torch.save_file` orders it
    (every tensor then starts at a multiple of its element size); each tensor is written at its
    offset as it comes. Written to a temporary name and renamed. Raises ValueError when `values`
    runs out or a tensor's name, dtype or shape differs from the layout (no file is left)."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(layout)), key=lambda i: -layout[i][1].element_size())
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, offset = [0] * len(layout), 0
    for i in order:
        name, meta = layout[i]
        dtype = str(meta.dtype).removeprefix("torch.")
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
        nbytes = meta.numel() * meta.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offsets[i], offset = offset, offset + nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    target = directory / filename
    tmp = directory / f".{filename}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            start = f.tell()
            f.truncate(start + offset)
            for i, (name, meta) in enumerate(layout):
                try:
                    got, tensor = next(values)
                except StopIteration:
                    raise ValueError(f"no tensor left for {name!r}") from None
                want = (name, meta.dtype, tuple(meta.shape))
                if (got, tensor.dtype, tuple(tensor.shape)) != want:
                    raise ValueError(
                        f"{got} {tensor.dtype}{list(tensor.shape)} does not match {name} "
                        f"{meta.dtype}{list(meta.shape)}"
                    )
                data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                del tensor  # before the next one is made
                f.seek(start + offsets[i])
                f.write(memoryview(data))
                del data
        os.chmod(tmp, FILE_MODE)  # an engine of another user must read it (shellrl.files)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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
