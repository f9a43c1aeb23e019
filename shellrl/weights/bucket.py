"""Weight transport between the learner (sender) and engines (receivers): SGLang's flattened bucket.

Layout (as `sglang/srt/weight_sync/tensor_bucket.py:FlattenedTensorBucket`): named tensors are
concatenated in order into one 1-D uint8 buffer, each as `tensor.flatten().view(uint8)`; each
entry's metadata holds `name`, `dtype`, `shape`, and `start_idx`/`end_idx`/`numel` in **bytes**
(`end_idx = start_idx + numel`). `plan_bucket(..., align)` places each start at a multiple of
`align`: 1 is SGLang's unpadded layout (what its distributed receiver recomputes, and what the
learner sends); `ALIGN_BYTES` (the default) pads each start to 64 bytes so that tensors of mixed
dtypes can each be viewed in place (`layout_align` picks between them). Receivers of
`/update_weights_from_tensor` only ever follow the offsets. A bucket is filled from the tensors
at hand (`flatten_into`) or streamed: the layout planned from descriptions (`describe`: meta
tensors) and each tensor copied in as an iterator makes it (`fill_from`: the sharded learner's
push gathers one parameter at a time).

Transports of the buffer (the `serialized_named_tensors` entries of `/update_weights_from_tensor`):
* SGLang's envelope (`shellrl.weights.sglang`): base64 of an allow-listed pickle of the bucket,
  CPU bytes in torch's file-system shared memory; what the learner sends on CPU, what SGLang reads.
* shellrl's JSON payloads, read only by shellrl's engine (SGLang refuses them: not base64):
  - shared memory (`shellrl.weights.shm.SharedMemoryBucket`): a named POSIX segment and JSON
    `{"transport": "shm", "segment", "nbytes", "metadata"}`; the engine maps it, copies, unmaps;
  - CUDA IPC (`shellrl.weights.gpu`): the buffer lives on the engine's GPU; the JSON carries the CUDA
    IPC memory handle (from torch.multiprocessing's reductions) and the GPU's UUID, so it opens
    under any `CUDA_VISIBLE_DEVICES` numbering.
* disk: a safetensors directory (`shellrl.weights.disk`); a gloo/NCCL broadcast:
  `shellrl.weights.distributed`.
The GPU transports are `CudaIpcBucket` (CUDA IPC, `shellrl.weights.gpu`) and the page-locked
`PinnedHostBucket` for GPUs without peer access (`shellrl.weights.pinned`);
benchmarks/bench_gpu_weight_sync.py measures them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ALIGN_BYTES = 64
LOAD_FORMAT = "flattened_bucket"
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
)


@cache
def _torch():
    import torch  # imported on first use: shellrl's shared library keeps torch out of import time

    return torch


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a flattened bucket. Offsets and `numel` are bytes (SGLang's meaning)."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"
    shape: tuple[int, ...]
    start_idx: int
    end_idx: int
    numel: int

    @staticmethod
    def from_json(entry: dict) -> TensorMeta:
        """Validated metadata from untrusted JSON; raises ValueError naming the problem."""
        try:
            meta = TensorMeta(
                str(entry["name"]),
                str(entry["dtype"]),
                tuple(int(s) for s in entry["shape"]),
                int(entry["start_idx"]),
                int(entry["end_idx"]),
                int(entry["numel"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad tensor metadata {entry!r}: {exc}") from exc
        expected = dtype_from_name(meta.dtype).itemsize
        for s in meta.shape:
            expected *= s
        if (
            min(meta.shape, default=0) < 0
            or meta.start_idx < 0
            or meta.end_idx - meta.start_idx != meta.numel
            or meta.numel != expected
        ):
            raise ValueError(
                f"{meta.name}: byte range [{meta.start_idx}, {meta.end_idx}) does not hold "
                f"{meta.dtype}{list(meta.shape)}"
            )
        return meta


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for a name like "bfloat16"; ValueError for anything outside DTYPE_NAMES."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}")
    return getattr(_torch(), name)


def plan_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]], align: int = ALIGN_BYTES
) -> tuple[list[TensorMeta], int]:
    """Metadata and total buffer size in bytes for these tensors, in order, each start a multiple
    of `align` bytes (1: SGLang's unpadded `FlattenedTensorBucket` layout)."""
    metadata, offset = [], 0
    for name, tensor in named_tensors:
        offset = -(-offset // align) * align
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(
            TensorMeta(
                name,
                str(tensor.dtype).removeprefix("torch."),
                tuple(tensor.shape),
                offset,
                offset + nbytes,
                nbytes,
            )
        )
        offset += nbytes
    return metadata, offset


def layout_align(dtypes: Iterable) -> int:
    """Start alignment for a bucket of tensors of these dtypes: 1 (SGLang's unpadded layout) when
    they share one dtype, as every offset is then a multiple of its element size; else
    ALIGN_BYTES, so that every tensor can still be viewed in place as its dtype."""
    return 1 if len(set(dtypes)) <= 1 else ALIGN_BYTES


def flatten_into(
    named_tensors: list[tuple[str, torch.Tensor]],
    buffer: torch.Tensor,
    align: int = ALIGN_BYTES,
    dtype=None,
) -> list[TensorMeta]:
    """Copy the tensors into `buffer` (1-D uint8 of at least `plan_bucket(..., align)[1]` bytes of
    their layout, any device); returns their metadata. dtype: None, or the torch dtype floating
    tensors travel in (`sent_dtype`): the layout is planned in it and each such tensor is cast by
    its copy (no temporary); the metadata names it."""
    torch = _torch()
    planned = named_tensors if dtype is None else describe(named_tensors, dtype)
    metadata, nbytes = plan_bucket(planned, align)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < nbytes:
        raise ValueError(f"buffer must be 1-D uint8 of >= {nbytes} bytes")
    for meta, (_, tensor), (_, slot) in zip(metadata, named_tensors, planned):
        raw = buffer[meta.start_idx : meta.end_idx]
        if slot.dtype == tensor.dtype:
            raw.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        else:  # start aligned to the cast dtype's size: plan_bucket(layout_align(...)) of the plan
            raw.view(slot.dtype).copy_(tensor.detach().reshape(-1))
    return metadata


def sent_dtype(tensor: torch.Tensor, dtype) -> torch.dtype:
    """The dtype `tensor` travels in when a push casts to `dtype` (None: no cast): floating tensors
    take `dtype`, others (integer buffers) keep theirs."""
    return tensor.dtype if dtype is None or not tensor.is_floating_point() else dtype


def describe(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype=None
) -> list[tuple[str, torch.Tensor]]:
    """`(name, meta tensor)` of the same shape per tensor, in its dtype or the one it travels in
    (`sent_dtype(t, dtype)`): a layout without the data, for `plan_bucket` and a bucket filled by
    `fill_from` (a DTensor gives its global shape)."""
    torch = _torch()
    return [
        (n, torch.empty(t.shape, dtype=sent_dtype(t, dtype), device="meta"))
        for n, t in named_tensors
    ]


def fill_from(
    metadata: list[TensorMeta], values: Iterator[tuple[str, torch.Tensor]], buffer: torch.Tensor
) -> set:
    """Copy the next `len(metadata)` (name, tensor) pairs of `values` into their slots of `buffer`
    (1-D uint8, any device, laid out by `metadata`), one at a time as the iterator makes them:
    each is dropped before the next is taken, so a producer that makes them on demand (the
    sharded learner's all-gather per parameter) has at most one alive here. Returns the devices
    the tensors came from. Raises ValueError when `values` runs out or a tensor's name, dtype or
    shape differs from its slot (the rest of `values` is left to the caller)."""
    torch = _torch()
    devices = set()
    for meta in metadata:
        try:
            name, tensor = next(values)
        except StopIteration:
            raise ValueError(f"no tensor left for slot {meta.name!r}") from None
        dtype = str(tensor.dtype).removeprefix("torch.")
        if (name, dtype, tuple(tensor.shape)) != (meta.name, meta.dtype, meta.shape):
            raise ValueError(
                f"{name} {dtype}{list(tensor.shape)} does not match slot {meta.name} "
                f"{meta.dtype}{list(meta.shape)}"
            )
        devices.add(tensor.device)
        buffer[meta.start_idx : meta.end_idx].copy_(
            tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        )
        del tensor  # before the next one is made
    return devices


def flatten_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], device=None
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """A new flattened bucket: (buffer [nbytes] uint8 on `device` (default: the first tensor's), metadata)."""
    torch = _torch()
    named_tensors = list(named_tensors)
    if not named_tensors:
        raise ValueError("cannot flatten an empty list of tensors")
    _, nbytes = plan_bucket(named_tensors)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device or named_tensors[0][1].device)
    return buffer, flatten_into(named_tensors, buffer)


def unflatten_tensors(
    buffer: torch.Tensor, metadata: Iterable[TensorMeta]
) -> list[tuple[str, torch.Tensor]]:
    """Views `(name, tensor)` into `buffer` (no copy where aligned; unaligned entries are copied).

    Raises ValueError when an entry lies outside the buffer.
    """
    out = []
    for meta in metadata:
        if meta.end_idx > buffer.numel():
            raise ValueError(
                f"{meta.name}: bytes [{meta.start_idx}, {meta.end_idx}) exceed the "
                f"{buffer.numel()}-byte buffer"
            )
        raw = buffer[meta.start_idx : meta.end_idx]
        dtype = dtype_from_name(meta.dtype)
        if meta.start_idx % dtype.itemsize:
            raw = raw.clone()
        out.append((meta.name, raw.view(dtype).reshape(meta.shape)))
    return out


def _views(buffer, metadata: list[TensorMeta]) -> list:
    """A tensor view into `buffer` per entry (its dtype and shape); starts are aligned by plan_bucket."""
    return [
        buffer[m.start_idx : m.end_idx].view(dtype_from_name(m.dtype)).view(m.shape)
        for m in metadata
    ]


def _metadata_json(metadata: Iterable[TensorMeta]) -> list[dict]:
    return [asdict(m) | {"shape": list(m.shape)} for m in metadata]
