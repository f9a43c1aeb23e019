"""GPU weight transports (learner side and receiver side): a flattened bucket on the engine's GPU shared
by CUDA IPC (`CudaIpcBucket`, `serialize_cuda_bucket`, `open_cuda_bucket`, `open_ready_event`); the
page-locked shared-memory bucket for GPUs without peer access is `shellrl.weights.pinned`. The layout is in
`shellrl.weights.bucket`, the shared-memory transport in `shellrl.weights.shm`, safetensors on disk
in `shellrl.weights.disk`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from shellrl.weights.bucket import (
    TensorMeta,
    _metadata_json,
    _torch,
    _views,
    describe,
    fill_from,
    layout_align,
    plan_bucket,
)
from shellrl.weights.sglang import BucketEnvelope, to_entry

if TYPE_CHECKING:
    import torch


# ----- CUDA IPC (GPU, same host) ----------------------------------------------------------------------


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def serialize_cuda_bucket(
    buffer: torch.Tensor,
    metadata: list[TensorMeta],
    *,
    metadata_json: str | None = None,
    ready_event_handle: bytes | None = None,
) -> str:
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
    (
        _,
        size,
        _,
        tensor_offset,
        _,
        _,
        device_index,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    handle_json = {
        "device_uuid": str(torch.cuda.get_device_properties(device_index).uuid),
        "numel": int(size[0]),
        "tensor_offset": int(tensor_offset),
        "handle": _b64(handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }
    if metadata_json is None:
        metadata_json = json.dumps(_metadata_json(metadata))
    ready = "" if ready_event_handle is None else f'"ready_event": "{_b64(ready_event_handle)}", '
    return (
        f'{{"transport": "cuda_ipc", "nbytes": {int(size[0])}, "handle": {json.dumps(handle_json)}, '
        f'{ready}"metadata": {metadata_json}}}'
    )


def open_cuda_bucket(
    payload: dict, metadata: list[TensorMeta] | None = None
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """Receiver side: the producer's buffer (no copy) on the local device with the same GPU UUID.

    metadata: the payload's metadata already parsed (skips parsing it again).
    Raises ValueError for a bad payload or when no visible device has that UUID.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch = _torch()
    h = payload.get("handle") or {}
    if metadata is None:
        metadata = [TensorMeta.from_json(m) for m in payload.get("metadata") or []]
    uuids = {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }
    if h.get("device_uuid") not in uuids:
        raise ValueError(
            f"GPU {h.get('device_uuid')!r} is not visible here (visible: {sorted(uuids)})"
        )
    try:
        buffer = rebuild_cuda_tensor(
            torch.Tensor,
            (int(h["numel"]),),
            (1,),
            int(h["tensor_offset"]),
            torch.UntypedStorage,
            torch.uint8,
            uuids[h["device_uuid"]],
            base64.b64decode(h["handle"]),
            int(h["storage_size_bytes"]),
            int(h["storage_offset_bytes"]),
            False,
            base64.b64decode(h["ref_counter_handle"]),
            int(h["ref_counter_offset"]),
            base64.b64decode(h["event_handle"]) if h.get("event_handle") else None,
            bool(h["event_sync_required"]),
        )
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
        self._layouts: dict[tuple, list] = {}  # layout key -> [metadata, nbytes, views or None]
        self._source_views: list | None = None
        self._payload: tuple[tuple, str] | None = (
            None  # ((buffer address, layout key), payload JSON)
        )
        self._chunks: list = []  # staging="bucket": _chunk_ranges of the layout
        self._link_stream = None  # ... and the side stream of the copies to `device`
        self._ready = None  # fill(sync=False): the interprocess event the engine waits on
        self._envelope = (
            BucketEnvelope()
        )  # entries(): SGLang's envelope, metadata pickled per layout
        self._shares = 0  # entries() shares of the current buffer (see SHARES_PER_BUFFER)

    @staticmethod
    def _ensure(buffer, nbytes: int, device):
        if buffer is None or buffer.numel() < nbytes or buffer.device != device:
            return _torch().empty(nbytes, dtype=_torch().uint8, device=device)
        return buffer

    def _layout(self, named_tensors: list, source, dtype=None) -> None:
        """The layout of these tensors (sent in `dtype`) and the buffer's views for it. Layouts are
        remembered (`_layouts`, views while the buffer stays): a streamed push's slot takes the
        same few buckets in turn, push after push, so planning and ~10 us of host time per view
        are paid once per bucket, not per fill."""
        key = (source, dtype, tuple((n, t.dtype, tuple(t.shape)) for n, t in named_tensors))
        if key == self._key:
            return
        known = self._layouts.get(key)
        if known is None:
            planned = named_tensors if dtype is None else describe(named_tensors, dtype)
            known = self._layouts[key] = [
                *plan_bucket(planned, layout_align(t.dtype for _, t in planned)),
                None,
            ]
        self._metadata, self._nbytes = known[0], known[1]
        buffer = self._ensure(self.buffer, self._nbytes, self.device)
        if buffer is not self.buffer:  # views of the old buffer are no use
            for layout in self._layouts.values():
                layout[2] = None
            self.buffer = buffer
        if known[2] is None:
            known[2] = _views(self.buffer, self._metadata)
        self._views, self._metadata_json = known[2], None
        self._source_views, self._key = None, key

    def fill(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        staging: str = "bucket",
        sync: bool = True,
        values: Iterator[tuple[str, torch.Tensor]] | None = None,
        dtype=None,
        payload: bool = True,
    ) -> str:
        """Copy `named_tensors` into the bucket; returns the CUDA IPC payload (JSON string), or ""
        with payload=False (a caller that sends `entries`, SGLang's envelope, needs none: making
        it costs a CUDA IPC share of the buffer).

        dtype: None, or the torch dtype floating tensors are sent in (e.g. the engine's bfloat16
        for a float32 learner): the layout and metadata name it and each copy casts (no
        temporary copy of a tensor; not with `values`).

        values: None, or an iterator of (name, tensor) streamed into the layout of `named_tensors`
        (then descriptions: `bucket.describe`) one tensor at a time, each copied straight into its
        slot and dropped before the next is made (`bucket.fill_from`; `staging` is not used): the
        sharded learner's push, which gathers one parameter at a time. The payload is the same.

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
        if self._shares >= SHARES_PER_BUFFER:
            self._rotate()
        if values is not None and dtype is not None:
            raise ValueError("a streamed fill (values) cannot cast; give dtype=None")
        self._layout(named_tensors, source, dtype)
        tensors = [t for _, t in named_tensors]
        sources = {source}
        if values is not None:
            sources = fill_from(self._metadata, values, self.buffer)
        elif staging == "direct" or source == self.device:
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
            for device in {self.device, *sources}:
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
        if not payload:
            return ""
        key = (self.buffer.data_ptr(), self._key, ready is not None)
        if self._payload is None or self._payload[0] != key:
            if self._metadata_json is None:
                self._metadata_json = json.dumps(_metadata_json(self._metadata))
            self._payload = (
                key,
                serialize_cuda_bucket(
                    self.buffer,
                    self._metadata,
                    metadata_json=self._metadata_json,
                    ready_event_handle=None if ready is None else ready.ipc_handle(),
                ),
            )
        return self._payload[1]

    def entries(self, count: int = 1) -> list[str]:
        """SGLang's `serialized_named_tensors` for the bucket's current contents: `count` entries (one
        per engine TP rank), each base64 of `MultiprocessingSerializer.serialize({"flattened_tensor":
        <the bucket, CUDA uint8>, "metadata": [FlattenedTensorMetadata]})` with the tensor shared by
        torch's CUDA IPC reduction under SGLang's `_rebuild_cuda_tensor_modified` (GPU named by UUID),
        as SGLang's own client sends it (sglang.srt.utils.patch_torch; decoded by SGLang's code in
        tests/gpu/test_gpu_weight_sync.py).

        Call after `fill` returned, before the engine reads. Each entry is a fresh reduction: torch
        records an interprocess event on the bucket device's current stream (after the fill's copies)
        and the receiver waits on it before reading, so `fill(sync=False)` needs no host wait; each
        takes a reference-counter slot the receiver releases. torch keeps an event per share until the
        buffer is freed (and synchronizes instead after 1,000), so the buffer is replaced every
        SHARES_PER_BUFFER shares (`_rotate`). Raises ValueError before the first fill.
        """
        if self.buffer is None:
            raise ValueError("fill the bucket before sharing it")
        self._shares += count
        flat = self.buffer[: self._nbytes]
        return [to_entry(self._envelope.serialize(flat, self._metadata)) for _ in range(count)]

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the bucket's buffer on `device` (0 before the first fill and once closed)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def _rotate(self) -> None:
        """A fresh buffer for the next fill: the old one (and torch's per-share events and
        reference counters on it) is freed once every engine released its mapping; torch keeps it
        in its IPC limbo until then, collected here at the next rotation. Costs the bucket's bytes
        on `device` a second time until the engine maps the new buffer (next update)."""
        self.close()
        self._shares = 0
        _torch().cuda.ipc_collect()

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
        if (
            self._ready is not None and self.buffer is not None
        ):  # copies of a fill(sync=False) may still run
            _torch().cuda.synchronize(self.device)
            if self._source is not None:
                _torch().cuda.synchronize(self._source.device)
        self.buffer = self._source = self._views = self._source_views = self._key = (
            self._payload
        ) = None
        self._layouts = {}
        self._ready = None


PIPELINE_CHUNKS = 8  # CudaIpcBucket staging="bucket": flatten/copy overlap granularity
SHARES_PER_BUFFER = (
    256  # CudaIpcBucket.entries: envelope shares of one buffer before it is replaced
)


def _next_boundary(lo: int, total: int, chunks: int) -> float:
    """The first of the byte boundaries k * total / chunks (k = 1..chunks) above `lo`."""
    return total * (lo * chunks // total + 1) / chunks


def _chunk_ranges(
    metadata: list[TensorMeta], chunks: int
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Split the layout into at most `chunks` runs of whole tensors, in order:
    [((first tensor, end tensor), (first byte, end byte))], covering every tensor and byte once. A run
    ends at the first tensor reaching the next boundary k * total / chunks beyond its start (boundaries
    a large tensor already crossed are skipped, so it leaves no trail of tiny runs)."""
    if not metadata:
        return []
    total = metadata[-1].end_idx
    out, first, lo = [], 0, 0
    for k, m in enumerate(metadata):
        last = k == len(metadata) - 1
        if last or m.end_idx >= _next_boundary(lo, total, chunks):
            hi = total if last else metadata[k + 1].start_idx
            out.append(((first, k + 1), (lo, hi)))
            first, lo = k + 1, hi
    return out


def _copy_all(destinations: list, sources: list) -> None:
    """destinations[i].copy_(sources[i]) for all i, fused where torch can (same device); per tensor else."""
    torch = _torch()
    if all(d.device == s.device for d, s in zip(destinations, sources)):
        torch._foreach_copy_(destinations, sources)
    else:  # across devices: one copy per tensor (the per-tensor path measures exactly this)
        for d, s in zip(destinations, sources):
            d.copy_(s)
