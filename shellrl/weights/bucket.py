"""Weight transport between the learner (sender) and engines (receivers): SGLang's flattened bucket.

Layout (as `sglang/srt/weight_sync/tensor_bucket.py:FlattenedTensorBucket`): named tensors are
concatenated in order into one 1-D uint8 buffer, each as `tensor.flatten().view(uint8)`; each
entry's metadata holds `name`, `dtype`, `shape`, and `start_idx`/`end_idx`/`numel` in **bytes**
(`end_idx = start_idx + numel`). `plan_bucket(..., align)` places each start at a multiple of
`align`: 1 is SGLang's unpadded layout (what its distributed receiver recomputes, and what the
learner sends); `ALIGN_BYTES` (the default) pads each start to 64 bytes so that tensors of mixed
dtypes can each be viewed in place (`layout_align` picks between them). Receivers of
`/update_weights_from_tensor` only ever follow the offsets.

Transports of the buffer (the `serialized_named_tensors` entries of `/update_weights_from_tensor`):
* SGLang's envelope (`shellrl.weights.sglang`): base64 of an allow-listed pickle of the bucket,
  CPU bytes in torch's file-system shared memory; what the learner sends on CPU, what SGLang reads.
* shellrl's JSON payloads, read only by shellrl's engine (SGLang refuses them: not base64):
  - shared memory (`SharedMemoryBucket`): a named POSIX segment and JSON
    `{"transport": "shm", "segment", "nbytes", "metadata"}`; the engine maps it, copies, unmaps;
  - CUDA IPC (`shellrl.weights.gpu`): the buffer lives on the engine's GPU; the JSON carries the CUDA
    IPC memory handle (from torch.multiprocessing's reductions) and the GPU's UUID, so it opens
    under any `CUDA_VISIBLE_DEVICES` numbering.
* disk: a safetensors directory (`shellrl.weights.disk`); a gloo/NCCL broadcast:
  `shellrl.weights.distributed`.
The GPU transports (CUDA IPC, `CudaIpcBucket`, and the page-locked `PinnedHostBucket` for GPUs without
peer access) are in `shellrl.weights.gpu`; benchmarks/bench_gpu_weight_sync.py measures them.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cache
from multiprocessing import shared_memory
from pathlib import Path
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
    named_tensors: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, align: int = ALIGN_BYTES
) -> list[TensorMeta]:
    """Copy the tensors into `buffer` (1-D uint8 of at least `plan_bucket(..., align)[1]` bytes,
    any device); returns their metadata."""
    torch = _torch()
    metadata, nbytes = plan_bucket(named_tensors, align)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < nbytes:
        raise ValueError(f"buffer must be 1-D uint8 of >= {nbytes} bytes")
    for meta, (_, tensor) in zip(metadata, named_tensors):
        buffer[meta.start_idx : meta.end_idx].copy_(
            tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        )
    return metadata


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


# ----- shared memory (CPU, same host) ------------------------------------------------------------------


class KeptHostBucket:
    """Learner side: a flattened bucket in host memory that engines map, kept and refilled by every
    push. Subclasses own the memory (`_buffer`, `_capacity`, `_free`) and the payload format:
    `SharedMemoryBucket` (a named POSIX segment, shellrl's JSON payload) and
    `shellrl.weights.sglang.SharedTensorBucket` (torch's file-system shared memory, SGLang's
    envelope). `align`: the start alignment of each tensor in bytes (`plan_bucket`).
    """

    align = ALIGN_BYTES

    def _buffer(self, nbytes: int):
        """A 1-D uint8 tensor over the first `nbytes` bytes of the memory (a fresh view)."""
        raise NotImplementedError

    def _capacity(self) -> int:
        """Bytes the memory holds (0 once freed)."""
        raise NotImplementedError

    def _free(self) -> None:
        """Release the memory (idempotent)."""
        raise NotImplementedError

    def _fill(self, named_tensors: list) -> None:
        _, nbytes = plan_bucket(named_tensors, self.align)
        buffer = self._buffer(nbytes)
        self.metadata, self.nbytes = flatten_into(named_tensors, buffer, self.align), nbytes
        del buffer  # no exported view may outlive the memory (close() unmaps)

    def adopt(self, parameters: list) -> None:
        """Make `parameters` (the tensors this bucket holds, in order, CPU) live in the segment: each
        `p.data` becomes its view, so the optimizer writes the weights straight into shared memory and
        a refill with the same tensors copies nothing (one memcpy of the model less per push). The
        segment must hold their current values (call right after creating or refilling it), and nothing
        may use the parameters meanwhile. `close()` moves them back to private memory first.
        Raises ValueError when a parameter does not match its slot (dtype, shape, CPU)."""
        torch = _torch()
        parameters = list(parameters)
        if len(parameters) != len(self.metadata):
            raise ValueError(f"{len(parameters)} parameters for {len(self.metadata)} slots")
        views = _views(self._buffer(self.nbytes), self.metadata)
        for p, v in zip(parameters, views):
            if p.device.type != "cpu" or p.dtype != v.dtype or tuple(p.shape) != tuple(v.shape):
                raise ValueError(
                    f"parameter {p.dtype} {tuple(p.shape)} on {p.device} does not match its slot "
                    f"{v.dtype} {tuple(v.shape)}"
                )
        with torch.no_grad():
            for p, v in zip(parameters, views):
                p.data = v
        self._adopted = list(zip(parameters, views))

    @property
    def adopted(self) -> bool:
        return self._adopted is not None

    def _holds(self, tensors: list) -> bool:
        """True when `tensors` are exactly the adopted parameters' storage, in order (nothing to copy)."""
        return (
            self._adopted is not None
            and len(tensors) == len(self._adopted)
            and all(
                t.data_ptr() == v.data_ptr() and t.shape == v.shape and t.dtype == v.dtype
                for t, (_, v) in zip(tensors, self._adopted)
            )
        )

    def refill(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> KeptHostBucket:
        """Write new tensors into the same segment: its pages are mapped already, so this is a plain
        memcpy (a fresh segment pays a page fault per 4 KiB); nothing at all when they are the adopted
        parameters (`adopt`). Call it only after every engine has read the previous contents (its
        update call returned). Raises ValueError if they do not fit."""
        named_tensors = list(named_tensors)
        if self._holds([t for _, t in named_tensors]):
            return self
        self._release_adopted()
        _, nbytes = plan_bucket(named_tensors, self.align)
        if nbytes > self._capacity():
            raise ValueError(f"{nbytes} bytes do not fit the segment ({self._capacity()} bytes)")
        self._fill(named_tensors)
        return self

    def _release_adopted(self) -> None:
        """Adopted parameters move back to private memory (a copy each), so that the segment can be
        rewritten or unmapped while nothing of the model lives in it."""
        if self._adopted is None:
            return
        torch = _torch()
        with torch.no_grad():
            for p, _ in self._adopted:
                p.data = p.data.clone()
        self._adopted = None

    def close(self) -> None:
        """Free the memory (idempotent); adopted parameters are moved out first."""
        self._release_adopted()
        self._free()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SharedMemoryBucket(KeptHostBucket):
    """Learner side: a flattened bucket in a named POSIX shared-memory segment (shellrl's JSON
    payload, which only shellrl's engine reads; SGLang's envelope is `shellrl.weights.sglang`).

    Use as a context manager: the segment is unlinked on exit (after the engines have copied it;
    SGLang's update call returns after the copy). `payload()` is the JSON string for
    `serialized_named_tensors`.
    """

    def __init__(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, prefix: str = "shellrl_w"
    ) -> None:
        named_tensors = list(named_tensors)
        if not named_tensors:
            raise ValueError("cannot share an empty list of tensors")
        _, nbytes = plan_bucket(named_tensors)
        self.name = f"{prefix}_{os.getpid()}_{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=max(nbytes, 1))
        self._adopted: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._fill(named_tensors)

    def _buffer(self, nbytes: int):
        torch = _torch()
        return torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)

    def _capacity(self) -> int:
        return self._shm.size if self._shm is not None else 0

    def payload(self) -> str:
        return json.dumps(
            {
                "transport": "shm",
                "segment": self.name,
                "nbytes": self.nbytes,
                "metadata": _metadata_json(self.metadata),
            }
        )

    def _free(self) -> None:
        """Unmap and unlink the segment (idempotent)."""
        if self._shm is None:
            return
        try:
            self._shm.close()
        except BufferError:  # a view is still referenced somewhere (e.g. by an autograd graph): the
            pass  # mapping stays until it is freed; the name is unlinked below all the same
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self._shm = None


@contextmanager
def open_shared_memory_bucket(payload: dict) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine side: map the segment named in a parsed shm payload and yield tensor views into it.

    The views are valid only inside the `with` block: copy what you keep. Raises ValueError for a
    bad payload, FileNotFoundError when the segment does not exist.
    """
    with open_shared_memory_buffer(payload) as (buffer, metadata):
        yield unflatten_tensors(buffer, metadata)


class SharedMemoryMapping:
    """Receiver side: a learner's segment mapped read-only, kept open across pushes.

    `key` = (segment name, inode, size): a learner that refills its kept segment
    (`SharedMemoryBucket.refill`) sends the same name every push, and a kept mapping sees the new
    bytes without mapping the segment again (MAP_POPULATE of 513 MiB costs ~60 ms here, as much as
    the copy out of it). A segment unlinked and made anew under the same name has a new inode.
    """

    def __init__(self, segment: str) -> None:
        if not segment or "/" in segment or len(segment) > 200:
            raise ValueError(f"bad shared-memory segment name {segment!r}")
        # Mapped straight from /dev/shm (where Linux keeps POSIX segments) rather than through
        # SharedMemory, whose resource tracker would unlink the learner's segment when we exit.
        fd = os.open(Path("/dev/shm") / segment, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.key = (segment, st.st_ino, st.st_size)
            # Shared and read-only: MAP_POPULATE maps every page now, in one call, instead of one page
            # fault per 4 KiB during the copy (Linux; 0 elsewhere). A private writable mapping would make
            # MAP_POPULATE copy every page (copy-on-write): 0.75 s instead of 0.12 s for 513 MiB here.
            self._mapping = (
                mmap.mmap(
                    fd,
                    st.st_size,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    prot=mmap.PROT_READ,
                )
                if st.st_size
                else None
            )
        finally:
            os.close(fd)
        torch = _torch()
        with warnings.catch_warnings():  # read-only on purpose: the views are only ever read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.buffer = (
                torch.frombuffer(self._mapping, dtype=torch.uint8)
                if self._mapping is not None
                else torch.empty(0, dtype=torch.uint8)
            )

    @staticmethod
    def current_key(segment: str) -> tuple:
        """(name, inode, size) of the segment now; FileNotFoundError when it is gone."""
        st = os.stat(Path("/dev/shm") / segment)
        return (segment, st.st_ino, st.st_size)

    def close(self) -> None:
        self.buffer = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view of it is still referenced: unmapped when that is freed
                pass
            self._mapping = None


@contextmanager
def open_shared_memory_buffer(payload: dict) -> Iterator[tuple[torch.Tensor, list[TensorMeta]]]:
    """Like `open_shared_memory_bucket`, but yields (the whole mapping as a 1-D uint8 tensor,
    validated metadata), for a receiver that copies the bucket in one piece; unmapped on exit."""
    metadata = [TensorMeta.from_json(m) for m in payload.get("metadata") or []]
    mapping = SharedMemoryMapping(str(payload.get("segment", "")))
    try:
        yield mapping.buffer, metadata
    finally:
        mapping.close()
