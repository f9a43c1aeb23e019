"""Weight transport between the learner (sender) and engines (receivers): SGLang's flattened bucket.

Layout (as `sglang/srt/weight_sync/tensor_bucket.py:FlattenedTensorBucket`): named tensors are
concatenated in order into one 1-D uint8 buffer, each as `tensor.flatten().view(uint8)`; each
entry's metadata holds `name`, `dtype`, `shape`, and `start_idx`/`end_idx`/`numel` in **bytes**
(`end_idx = start_idx + numel`). We pad each start to `ALIGN_BYTES` so every entry can be viewed
in place as its dtype; receivers only ever follow the offsets, so SGLang's reader accepts it.

Transports of the buffer (the `serialized_named_tensors` entries of `/update_weights_from_tensor`):
* shared memory (CPU, same host): the learner creates a named POSIX segment, flattens into it and
  sends JSON `{"transport": "shm", "segment", "nbytes", "metadata"}`; the engine maps it, copies,
  unmaps; the learner unlinks it after the HTTP call returned (`SharedMemoryBucket`).
* CUDA IPC (GPU, same host): the buffer lives on the engine's GPU; the JSON carries the CUDA IPC
  memory handle (from torch.multiprocessing's reductions) and the GPU's UUID, so it opens under any
  `CUDA_VISIBLE_DEVICES` numbering (`serialize_cuda_bucket` / `open_cuda_bucket`).
* disk: a safetensors directory (`save_safetensors_dir` / `load_safetensors_dir`).
Kept buffers for repeated pushes (issue 9): `CudaIpcBucket` (a bucket on the engine's GPU whose IPC
handle stays the same) and `PinnedHostBucket` (a page-locked shm segment, for GPUs without peer
access); benchmarks/bench_gpu_weight_sync.py measures them.
SGLang pickles these payloads (`MultiprocessingSerializer`); shellrl's engine never unpickles an
HTTP body, so every payload here is plain JSON plus a segment name or handle bytes (docs/sglang.md).
"""

from __future__ import annotations

import base64
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
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")


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
    def from_json(entry: dict) -> "TensorMeta":
        """Validated metadata from untrusted JSON; raises ValueError naming the problem."""
        try:
            meta = TensorMeta(str(entry["name"]), str(entry["dtype"]), tuple(int(s) for s in entry["shape"]),
                              int(entry["start_idx"]), int(entry["end_idx"]), int(entry["numel"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad tensor metadata {entry!r}: {exc}") from exc
        expected = dtype_from_name(meta.dtype).itemsize
        for s in meta.shape:
            expected *= s
        if min(meta.shape, default=0) < 0 or meta.start_idx < 0 or meta.end_idx - meta.start_idx != meta.numel \
                or meta.numel != expected:
            raise ValueError(f"{meta.name}: byte range [{meta.start_idx}, {meta.end_idx}) does not hold "
                             f"{meta.dtype}{list(meta.shape)}")
        return meta


def dtype_from_name(name: str) -> "torch.dtype":
    """torch dtype for a name like "bfloat16"; ValueError for anything outside DTYPE_NAMES."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}")
    return getattr(_torch(), name)


def plan_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Metadata and total buffer size in bytes for these tensors, in order, each start aligned."""
    metadata, offset = [], 0
    for name, tensor in named_tensors:
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                                   offset, offset + nbytes, nbytes))
        offset += nbytes
    return metadata, offset


def flatten_into(named_tensors: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> list[TensorMeta]:
    """Copy the tensors into `buffer` (1-D uint8 of at least `plan_bucket(...)[1]` bytes, any device)."""
    torch = _torch()
    metadata, nbytes = plan_bucket(named_tensors)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < nbytes:
        raise ValueError(f"buffer must be 1-D uint8 of >= {nbytes} bytes")
    for meta, (_, tensor) in zip(metadata, named_tensors):
        buffer[meta.start_idx:meta.end_idx].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return metadata


def flatten_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], device=None) -> tuple[torch.Tensor, list[TensorMeta]]:
    """A new flattened bucket: (buffer [nbytes] uint8 on `device` (default: the first tensor's), metadata)."""
    torch = _torch()
    named_tensors = list(named_tensors)
    if not named_tensors:
        raise ValueError("cannot flatten an empty list of tensors")
    _, nbytes = plan_bucket(named_tensors)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device or named_tensors[0][1].device)
    return buffer, flatten_into(named_tensors, buffer)


def unflatten_tensors(buffer: torch.Tensor, metadata: Iterable[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views `(name, tensor)` into `buffer` (no copy where aligned; unaligned entries are copied).

    Raises ValueError when an entry lies outside the buffer.
    """
    out = []
    for meta in metadata:
        if meta.end_idx > buffer.numel():
            raise ValueError(f"{meta.name}: bytes [{meta.start_idx}, {meta.end_idx}) exceed the "
                             f"{buffer.numel()}-byte buffer")
        raw = buffer[meta.start_idx:meta.end_idx]
        dtype = dtype_from_name(meta.dtype)
        if meta.start_idx % dtype.itemsize:
            raw = raw.clone()
        out.append((meta.name, raw.view(dtype).reshape(meta.shape)))
    return out


def _metadata_json(metadata: Iterable[TensorMeta]) -> list[dict]:
    return [asdict(m) | {"shape": list(m.shape)} for m in metadata]


# ----- shared memory (CPU, same host) ------------------------------------------------------------------


class SharedMemoryBucket:
    """Learner side: a flattened bucket in a named POSIX shared-memory segment.

    Use as a context manager: the segment is unlinked on exit (after the engines have copied it;
    SGLang's update call returns after the copy). `payload()` is the JSON string for
    `serialized_named_tensors`.
    """

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, prefix: str = "shellrl_w") -> None:
        named_tensors = list(named_tensors)
        if not named_tensors:
            raise ValueError("cannot share an empty list of tensors")
        _, nbytes = plan_bucket(named_tensors)
        self.name = f"{prefix}_{os.getpid()}_{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=max(nbytes, 1))
        self.nbytes = nbytes
        torch = _torch()
        buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.metadata = flatten_into(named_tensors, buffer)
        del buffer  # no exported view may outlive the segment (close() unmaps)
        self._adopted: list[tuple[torch.Tensor, torch.Tensor]] | None = None

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
        buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.nbytes)
        views = _views(buffer, self.metadata)
        for p, v in zip(parameters, views):
            if p.device.type != "cpu" or p.dtype != v.dtype or tuple(p.shape) != tuple(v.shape):
                raise ValueError(f"parameter {p.dtype} {tuple(p.shape)} on {p.device} does not match its slot "
                                 f"{v.dtype} {tuple(v.shape)}")
        with torch.no_grad():
            for p, v in zip(parameters, views):
                p.data = v
        self._adopted = list(zip(parameters, views))

    @property
    def adopted(self) -> bool:
        return self._adopted is not None

    def _holds(self, tensors: list) -> bool:
        """True when `tensors` are exactly the adopted parameters' storage, in order (nothing to copy)."""
        return (self._adopted is not None and len(tensors) == len(self._adopted)
                and all(t.data_ptr() == v.data_ptr() and t.shape == v.shape and t.dtype == v.dtype
                        for t, (_, v) in zip(tensors, self._adopted)))

    def refill(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "SharedMemoryBucket":
        """Write new tensors into the same segment: its pages are mapped already, so this is a plain
        memcpy (a fresh segment pays a page fault per 4 KiB); nothing at all when they are the adopted
        parameters (`adopt`). Call it only after every engine has read the previous contents (its
        update call returned). Raises ValueError if they do not fit."""
        named_tensors = list(named_tensors)
        if self._holds([t for _, t in named_tensors]):
            return self
        self._release_adopted()
        _, nbytes = plan_bucket(named_tensors)
        if self._shm is None or nbytes > self._shm.size:
            raise ValueError(f"{nbytes} bytes do not fit the segment ({self._shm.size if self._shm else 0} bytes)")
        torch = _torch()
        buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.metadata, self.nbytes = flatten_into(named_tensors, buffer), nbytes
        del buffer
        return self

    def payload(self) -> str:
        return json.dumps({"transport": "shm", "segment": self.name, "nbytes": self.nbytes,
                           "metadata": _metadata_json(self.metadata)})

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
        """Unmap and unlink the segment (idempotent); adopted parameters are moved out first."""
        if self._shm is None:
            return
        self._release_adopted()
        try:
            self._shm.close()
        except BufferError:  # a view is still referenced somewhere (e.g. by an autograd graph): the
            pass             # mapping stays until it is freed; the name is unlinked below all the same
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self._shm = None

    def __enter__(self) -> "SharedMemoryBucket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
            self._mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                      prot=mmap.PROT_READ) if st.st_size else None
        finally:
            os.close(fd)
        torch = _torch()
        with warnings.catch_warnings():  # read-only on purpose: the views are only ever read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.buffer = (torch.frombuffer(self._mapping, dtype=torch.uint8) if self._mapping is not None
                           else torch.empty(0, dtype=torch.uint8))

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


# ----- CUDA IPC (GPU, same host) ----------------------------------------------------------------------


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def serialize_cuda_bucket(buffer: torch.Tensor, metadata: list[TensorMeta], *, metadata_json: str | None = None,
                          ready_event_handle: bytes | None = None) -> str:
    """JSON payload with the CUDA IPC handle of `buffer` (1-D uint8 on a CUDA device).

    metadata_json: `json.dumps` of the metadata's JSON form, when the caller keeps it (a kept
    bucket sends the same layout every push); `metadata` is then not read.
    ready_event_handle: `ipc_handle()` of an interprocess CUDA event (on the buffer's device) that
    the producer recorded after writing the buffer; the receiver waits on it before reading
    (payload field `ready_event`, base64). None: the buffer is complete when the payload is sent.

    The producer must keep `buffer` alive until every receiver has finished copying (the update
    call returned), then may call `torch.cuda.ipc_collect()`. Uses torch.multiprocessing's
    `reduce_tensor`; the device is named by UUID (as sglang's `monkey_patch_torch_reductions`).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    torch = _torch()
    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("buffer must be a 1-D uint8 CUDA tensor")
    rebuild, args = reduce_tensor(buffer)
    if rebuild is not rebuild_cuda_tensor:
        raise RuntimeError(f"unexpected reduction {rebuild!r}")
    (_, size, _, tensor_offset, _, _, device_index, handle, storage_size_bytes, storage_offset_bytes, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    handle_json = {
        "device_uuid": str(torch.cuda.get_device_properties(device_index).uuid),
        "numel": int(size[0]), "tensor_offset": int(tensor_offset),
        "handle": _b64(handle), "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes), "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset), "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }
    if metadata_json is None:
        metadata_json = json.dumps(_metadata_json(metadata))
    ready = "" if ready_event_handle is None else f'"ready_event": "{_b64(ready_event_handle)}", '
    return (f'{{"transport": "cuda_ipc", "nbytes": {int(size[0])}, "handle": {json.dumps(handle_json)}, '
            f'{ready}"metadata": {metadata_json}}}')


def open_cuda_bucket(payload: dict, metadata: list[TensorMeta] | None = None) -> tuple[torch.Tensor, list[TensorMeta]]:
    """Receiver side: the producer's buffer (no copy) on the local device with the same GPU UUID.

    metadata: the payload's metadata already parsed (skips parsing it again).
    Raises ValueError for a bad payload or when no visible device has that UUID.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch = _torch()
    h = payload.get("handle") or {}
    if metadata is None:
        metadata = [TensorMeta.from_json(m) for m in payload.get("metadata") or []]
    uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    if h.get("device_uuid") not in uuids:
        raise ValueError(f"GPU {h.get('device_uuid')!r} is not visible here (visible: {sorted(uuids)})")
    try:
        buffer = rebuild_cuda_tensor(
            torch.Tensor, (int(h["numel"]),), (1,), int(h["tensor_offset"]), torch.UntypedStorage, torch.uint8,
            uuids[h["device_uuid"]], base64.b64decode(h["handle"]), int(h["storage_size_bytes"]),
            int(h["storage_offset_bytes"]), False, base64.b64decode(h["ref_counter_handle"]),
            int(h["ref_counter_offset"]), base64.b64decode(h["event_handle"]) if h.get("event_handle") else None,
            bool(h["event_sync_required"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad CUDA IPC handle: {exc}") from exc
    return buffer, metadata


def open_ready_event(payload: dict, device) -> torch.cuda.Event | None:
    """Receiver side: the payload's `ready_event` (see serialize_cuda_bucket) opened on `device`
    (the bucket's device), or None when the payload has none. Raises ValueError for a bad handle."""
    handle = payload.get("ready_event")
    if handle is None:
        return None
    try:
        return _torch().cuda.Event.from_ipc_handle(device, base64.b64decode(handle))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"bad ready_event handle: {exc}") from exc


class CudaIpcBucket:
    """Learner side: one flattened bucket on `device` (the engine's GPU), kept and refilled by every push.

    Keeping the buffer is what makes CUDA IPC cheap: its IPC handle stays the same, so an engine that
    keeps the last bucket it opened (services/engine/weights.py) maps it once, not once per push.
    The layout (metadata, its JSON, a view per tensor) is kept too while the tensors' names, dtypes
    and shapes stay the same, and the copies are one fused `torch._foreach_copy_`, so a refill costs
    the copies, not ~10 Python/torch calls per tensor. `fill` returns the `serialized_named_tensors`
    JSON entry:
    * staging="bucket": flatten on the tensors' own GPU into a second kept buffer (fast local copies)
      and copy it to `device` in PIPELINE_CHUNKS large DMAs over NVLink/PCIe, each overlapping the
      flatten of the next chunk;
    * staging="direct": copy each tensor straight into the bucket on `device` (a copy per tensor
      across the link; the per-tensor baseline).
    Both devices are synchronized before the payload is returned, so the engine may read at once.
    Memory: the bucket (sum of the tensors' bytes, 64-byte aligned) on `device`, plus as much again
    on the source GPU with staging="bucket". The buffer must outlive the engine's copy; `close()`
    drops it (the caching allocator frees it once no engine holds the handle open).
    """

    def __init__(self, device) -> None:
        torch = _torch()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaIpcBucket needs a CUDA device; got {device!r}")
        self.buffer: torch.Tensor | None = None
        self._source: torch.Tensor | None = None
        self._key: tuple | None = None
        self._metadata: list[TensorMeta] = []
        self._metadata_json = "[]"
        self._nbytes = 0
        self._views: list | None = None
        self._source_views: list | None = None
        self._payload: tuple[tuple, str] | None = None  # ((buffer address, layout key), payload JSON)
        self._chunks: list = []  # staging="bucket": _chunk_ranges of the layout
        self._link_stream = None  # ... and the side stream of the copies to `device`
        self._ready = None  # fill(sync=False): the interprocess event the engine waits on

    @staticmethod
    def _ensure(buffer, nbytes: int, device):
        if buffer is None or buffer.numel() < nbytes or buffer.device != device:
            return _torch().empty(nbytes, dtype=_torch().uint8, device=device)
        return buffer

    def _layout(self, named_tensors: list, source) -> None:
        key = (source, tuple((n, t.dtype, tuple(t.shape)) for n, t in named_tensors))
        if key == self._key:
            return
        self._metadata, self._nbytes = plan_bucket(named_tensors)
        self._metadata_json = json.dumps(_metadata_json(self._metadata))
        self.buffer = self._ensure(self.buffer, self._nbytes, self.device)
        self._views = _views(self.buffer, self._metadata)
        self._source_views, self._key = None, key

    def fill(self, named_tensors: Iterable[tuple[str, torch.Tensor]], staging: str = "bucket",
             sync: bool = True) -> str:
        """Copy `named_tensors` into the bucket; returns the CUDA IPC payload (JSON string).

        sync=True: returns once the copies are done on both GPUs. sync=False: returns once they are
        enqueued; the payload then carries `ready_event`, the IPC handle of an interprocess CUDA event
        recorded after the copies, and the engine makes its stream wait on it before it reads the
        bucket, so the update call can travel while the bytes do. The caller must send the payload
        only after `fill` returned (the engine waits for the event's latest record) and must not
        refill before the engine answered the update.
        Raises ValueError for an empty list or an unknown `staging`.
        """
        torch = _torch()
        named_tensors = [(n, t.detach()) for n, t in named_tensors]
        if not named_tensors:
            raise ValueError("cannot fill a bucket with an empty list of tensors")
        if staging not in ("bucket", "direct"):
            raise ValueError(f"staging must be 'bucket' or 'direct'; got {staging!r}")
        source = named_tensors[0][1].device
        self._layout(named_tensors, source)
        tensors = [t for _, t in named_tensors]
        if staging == "direct" or source == self.device:
            _copy_all(self._views, tensors)
        else:
            if self._source_views is None:
                self._source = self._ensure(self._source, self._nbytes, source)
                self._source_views = _views(self._source, self._metadata)
                self._chunks = _chunk_ranges(self._metadata, PIPELINE_CHUNKS)
                self._link_stream = torch.cuda.Stream(source)
            self._pipelined_stage(tensors, source)
        ready = None
        if sync:
            for device in {self.device, source}:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        else:
            # every copy into the bucket is ordered before `device`'s current stream (same-device copies
            # run on it; cross-device copy_ makes it wait on the copying stream), so one record covers all
            if self._ready is None:
                self._ready = torch.cuda.Event(interprocess=True)
            self._ready.record(torch.cuda.current_stream(self.device))
            ready = self._ready
        # The same payload string for every refill of the same buffer: the IPC memory handle names the
        # allocation, which stays the same, and so does the ready event; the share-time event of
        # reduce_tensor is not relied on (a fresh reduce_tensor per push would make a new event and
        # ref-counter slot, and a new string, which defeats the engine's cache of the opened bucket
        # and its validated layout).
        key = (self.buffer.data_ptr(), self._key, ready is not None)
        if self._payload is None or self._payload[0] != key:
            self._payload = (key, serialize_cuda_bucket(
                self.buffer, self._metadata, metadata_json=self._metadata_json,
                ready_event_handle=None if ready is None else ready.ipc_handle()))
        return self._payload[1]

    def _pipelined_stage(self, tensors: list, source) -> None:
        """Flatten on the source GPU and copy to `device` chunk by chunk, the copy of chunk k (on a side
        stream, one DMA over the link) overlapping the local flatten of chunk k+1: about
        max(flatten, link copy) + one chunk instead of their sum."""
        torch = _torch()
        main = torch.cuda.current_stream(source)
        self._link_stream.wait_stream(main)  # the buffer's previous readers and the optimizer step
        for (i, j), (lo, hi) in self._chunks:
            torch._foreach_copy_(self._source_views[i:j], tensors[i:j])
            flattened = torch.cuda.Event()
            flattened.record(main)
            with torch.cuda.stream(self._link_stream):
                self._link_stream.wait_event(flattened)
                self.buffer[lo:hi].copy_(self._source[lo:hi], non_blocking=True)
        main.wait_stream(self._link_stream)

    def close(self) -> None:
        if self._ready is not None and self.buffer is not None:  # copies of a fill(sync=False) may still run
            _torch().cuda.synchronize(self.device)
            if self._source is not None:
                _torch().cuda.synchronize(self._source.device)
        self.buffer = self._source = self._views = self._source_views = self._key = self._payload = None
        self._ready = None


PIPELINE_CHUNKS = 8  # CudaIpcBucket staging="bucket": flatten/copy overlap granularity


def _chunk_ranges(metadata: list[TensorMeta], chunks: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Split the layout into at most `chunks` runs of whole tensors of about equal bytes:
    [((first tensor, end tensor), (first byte, end byte))], covering every tensor and byte once."""
    if not metadata:
        return []
    total = metadata[-1].end_idx
    out, first, lo = [], 0, 0
    for k, m in enumerate(metadata):
        last = k == len(metadata) - 1
        if last or m.end_idx >= total * (len(out) + 1) / chunks:
            hi = total if last else metadata[k + 1].start_idx
            out.append(((first, k + 1), (lo, hi)))
            first, lo = k + 1, hi
    return out


def _views(buffer, metadata: list[TensorMeta]) -> list:
    """A tensor view into `buffer` per entry (its dtype and shape); starts are aligned by plan_bucket."""
    return [buffer[m.start_idx:m.end_idx].view(dtype_from_name(m.dtype)).view(m.shape) for m in metadata]


def _copy_all(destinations: list, sources: list) -> None:
    """destinations[i].copy_(sources[i]) for all i, fused where torch can (same device); per tensor else."""
    torch = _torch()
    if all(d.device == s.device for d, s in zip(destinations, sources)):
        torch._foreach_copy_(destinations, sources)
    else:  # across devices: one copy per tensor (the per-tensor path measures exactly this)
        for d, s in zip(destinations, sources):
            d.copy_(s)


def _cudart():
    torch = _torch()
    return torch.cuda.cudart() if torch.cuda.is_available() else None


class PinnedHostBucket:
    """Learner side, for GPUs without peer access: the bucket staged in host memory.

    One named POSIX shared-memory segment, kept and refilled by every push and page-locked
    (cudaHostRegister) when CUDA is available, so the GPU-to-host copy runs at DMA speed. A GPU
    model is flattened on its GPU first (into a kept buffer) and copied down in ONE copy. The
    engine reads the segment as an ordinary "shm" payload (`open_shared_memory_bucket`).
    Use as a context manager or call `close()`: it unregisters, unmaps and unlinks the segment.
    """

    def __init__(self, *, prefix: str = "shellrl_p") -> None:
        self.prefix = prefix
        self.name: str | None = None
        self.pinned = False
        self._shm: shared_memory.SharedMemory | None = None
        self._host: torch.Tensor | None = None
        self._source: torch.Tensor | None = None

    def _segment(self, nbytes: int):
        if self._host is not None and self._host.numel() >= nbytes:
            return self._host
        self.close()
        torch = _torch()
        self.name = f"{self.prefix}_{os.getpid()}_{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=max(nbytes, 1))
        self._host = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=max(nbytes, 1))
        cudart = _cudart()
        if cudart is not None:
            self.pinned = int(cudart.cudaHostRegister(self._host.data_ptr(), self._host.numel(), 0)) == 0
        return self._host

    def fill(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Copy `named_tensors` into the segment; returns the shm payload (JSON string)."""
        named_tensors = list(named_tensors)
        if not named_tensors:
            raise ValueError("cannot fill a bucket with an empty list of tensors")
        metadata, nbytes = plan_bucket(named_tensors)
        host = self._segment(nbytes)
        source = named_tensors[0][1].device
        if source.type == "cuda":
            self._source = CudaIpcBucket._ensure(self._source, nbytes, source)
            flatten_into(named_tensors, self._source)
            host[:nbytes].copy_(self._source[:nbytes])  # synchronous: the bytes are on the host after this
        else:
            flatten_into(named_tensors, host)
        return json.dumps({"transport": "shm", "segment": self.name, "nbytes": nbytes,
                           "metadata": _metadata_json(metadata)})

    def close(self) -> None:
        """Unregister, unmap and unlink the segment (idempotent)."""
        if self._shm is None:
            return
        if self.pinned:
            _cudart().cudaHostUnregister(self._host.data_ptr())
            self.pinned = False
        self._host = None  # no exported view may outlive the mapping
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        self._shm = None

    def __enter__(self) -> PinnedHostBucket:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----- disk (safetensors) -------------------------------------------------------------------------------


def save_safetensors_dir(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | Path,
                         filename: str = "model.safetensors") -> Path:
    """Write the tensors as one safetensors file in `directory` (created); returns the file path.
    Written to a temporary name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / filename
    tmp = directory / f".{filename}.tmp-{os.getpid()}"
    save_file({n: t.detach().contiguous().cpu() for n, t in named_tensors}, str(tmp), metadata={"format": "pt"})
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
