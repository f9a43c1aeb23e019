"""SGLang 0.5.23's envelope for `/update_weights_from_tensor`: the format and the sender side.

Wire format (`sglang/srt/managers/io_struct.py:UpdateWeightsFromTensorReqInput`, read by
`model_runner_components/weight_updater.py:_update_weights_from_flattened_bucket`):
`serialized_named_tensors` holds one base64 string per engine TP rank (rank r reads entry r), each
`MultiprocessingSerializer.serialize(obj)` (`sglang/srt/utils/common.py`: a ForkingPickler dump) of

    {"flattened_tensor": uint8 [nbytes],
     "metadata": [FlattenedTensorMetadata(name, shape: torch.Size, dtype: torch.dtype,
                                          start_idx, end_idx, numel)]}      # offsets in bytes

with `load_format: "flattened_bucket"` and SGLang's unpadded layout (each tensor right after the
previous one, `plan_bucket(..., align=1)`). SGLang unpickles it under its `SafeUnpickler`
allow-list. The tensor's bytes travel as torch's multiprocessing reductions share them:
* CPU: torch's "file_system" strategy, `rebuild_storage_filename(UntypedStorage, manager, handle,
  size)`: the bytes live in a /dev/shm file of torch's shm manager and the receiver maps it by name,
  so unrelated processes of one host can read it. (torch's default "file_descriptor" strategy
  hands a descriptor through the sender's multiprocessing resource sharer, which only the sender's
  own children can authenticate to.)
* CUDA: torch's CUDA IPC handle, rebuilt by `sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`
  with the GPU's UUID in place of its index, as SGLang's own client sends.

Sender: `serialize`, `to_entry`, `SharedTensorBucket` (kept and refilled push after push). shellrl
never imports sglang: `FlattenedTensorMetadata` below is pickled under SGLang's class path.
Receiver (an allow-listed unpickler mirroring SGLang's SafeUnpickler, validated decoding):
`shellrl.weights.safe_unpickle`.
"""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
import types
from dataclasses import dataclass
from typing import Any

from shellrl.weights.bucket import (
    TensorMeta,
    _torch,
    layout_align,
)
from shellrl.weights.shm import KeptHostBucket

LOAD_FORMAT = "flattened_bucket"
MAX_LAYOUTS = 256  # BucketEnvelope: layouts whose metadata pickle is kept
TENSOR_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
PATCH_TORCH_MODULE = "sglang.srt.utils.patch_torch"


@dataclass
class FlattenedTensorMetadata:
    """SGLang's `FlattenedTensorMetadata` (tensor_bucket.py), pickled under SGLang's class path.
    Offsets and `numel` are bytes into the flattened uint8 tensor."""

    name: str
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    @staticmethod
    def of(meta: TensorMeta) -> FlattenedTensorMetadata:
        torch = _torch()
        return FlattenedTensorMetadata(
            meta.name,
            torch.Size(meta.shape),
            getattr(torch, meta.dtype),
            meta.start_idx,
            meta.end_idx,
            meta.numel,
        )


# ----- sender ------------------------------------------------------------------------------------


def device_uuid(device: int | str) -> str:
    """The GPU's UUID string (what `_rebuild_cuda_tensor_modified` looks up); a string passes."""
    return (
        device if isinstance(device, str) else str(_torch().cuda.get_device_properties(device).uuid)
    )


def rebuild_cuda_tensor_by_uuid(*args):
    """SGLang's `_rebuild_cuda_tensor_modified`: torch's `rebuild_cuda_tensor` with argument 6 the
    GPU's UUID (or an index). Raises ValueError when no visible GPU has that UUID.

    One addition for a receiver that keeps the tensor between updates (shellrl's engine): torch
    waits on the sender's event (argument 13) only when it opens the memory handle, not when its
    cache already holds the mapping, so the current stream waits on the event here every time: a
    sender's later refill of the same buffer is then read only once its copies are done.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch = _torch()
    device = args[6]
    if isinstance(device, str):
        found = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not found:
            raise ValueError(f"GPU {device!r} is not visible here")
        device = found[0]
    tensor = rebuild_cuda_tensor(*args[:6], device, *args[7:])
    event_handle, event_sync_required = args[13], args[14]
    if event_sync_required and event_handle:
        event = torch.cuda.Event.from_ipc_handle(device, event_handle)
        torch.cuda.current_stream(device).wait_event(event)
    return tensor


def _reduce_tensor(tensor):
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        return rebuild_cuda_tensor_by_uuid, (*args[:6], device_uuid(args[6]), *args[7:])
    return rebuild, args


def _reduce_storage_by_filename(storage):
    """torch's `reduce_storage` under the "file_system" strategy, whatever this process's strategy:
    the storage moves to a named shm file (a no-op when it is in one) and gets a reference for the
    receiver, which drops it after mapping (`rebuild_storage_filename`)."""
    from torch.multiprocessing import reductions

    if storage.device.type != "cpu":
        raise pickle.PicklingError(f"cannot share a {storage.device} storage by file name")
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), *metadata)


class _EnvelopePickler(pickle._Pickler):
    """ForkingPickler's output for tensors, with SGLang's class paths for the stand-ins here.
    The pure-Python pickler, because a global's name is checked against an import there and
    shellrl does not import sglang: `save_global` writes SGLang's path for the stand-ins."""

    # the pure-Python pickler saves functions through its class-level dispatch (the base class's
    # save_global, not an override): route them through ours, so a stand-in function (the CUDA
    # rebuild) is written under SGLang's path
    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[types.FunctionType] = lambda self, obj: self.save_global(obj)

    def __init__(self, file, protocol: int = pickle.DEFAULT_PROTOCOL) -> None:
        from torch.multiprocessing import reductions

        torch = _torch()
        super().__init__(file, protocol=protocol)  # ForkingPickler's default protocol too
        self.dispatch_table = dict(copyreg.dispatch_table) | {
            torch.Tensor: _reduce_tensor,
            torch.nn.Parameter: _reduce_tensor,
            torch.storage.TypedStorage: reductions.reduce_typed_storage,
            torch.UntypedStorage: _reduce_storage_by_filename,
        }

    def save_global(self, obj, name=None) -> None:
        torch = _torch()
        if obj is FlattenedTensorMetadata:
            where = (TENSOR_BUCKET_MODULE, "FlattenedTensorMetadata")
        elif obj is rebuild_cuda_tensor_by_uuid:
            where = (PATCH_TORCH_MODULE, "_rebuild_cuda_tensor_modified")
        elif isinstance(obj, torch.dtype):
            where = ("torch", str(obj).removeprefix("torch."))
        else:
            return super().save_global(obj, name)
        self.save(where[0])
        self.save(where[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def serialize(obj) -> bytes:
    """`MultiprocessingSerializer.serialize(obj)` as SGLang's reader expects it (bytes)."""
    buffer = io.BytesIO()
    _EnvelopePickler(buffer).dump(obj)
    return buffer.getvalue()


class BucketEnvelope:
    """`serialize(bucket_object(flattened_tensor, metadata))` for a kept bucket whose layout stays
    the same push after push, at the cost of pickling the tensor only.

    The pure-Python pickler (needed for SGLang's class paths, see `_EnvelopePickler`) takes ~6 ms
    for the ~300 metadata entries of a 0.5B model; they change only with the layout, while the
    tensor must be reduced afresh every push (a CUDA tensor's reduction records the interprocess
    event the receiver waits on and takes a new reference-counter slot, which the receiver
    releases). So the dict is written as SGLang's reader sees any pickled dict,
    `PROTO 4, EMPTY_DICT, MEMOIZE, MARK, <"metadata", list>, <"flattened_tensor", tensor>,
    SETITEMS, STOP`, with the metadata pair pickled once per layout and the tensor pair pickled
    per call; each part's memo indices start where the previous part's end (protocol 4's MEMOIZE
    numbers entries implicitly), so the stream is exactly what one pickler would have written for
    that key order. Decoded by SGLang's own `MultiprocessingSerializer.deserialize`
    (tests/service/test_sglang_conformance.py).
    """

    def __init__(self) -> None:
        # layout -> (its metadata pair's opcodes, the memo size after them); a streamed push's
        # slot takes the same few layouts in turn, so each is pickled once
        self._parts: dict[tuple, tuple[bytes, int]] = {}

    def serialize(self, flattened_tensor, metadata: list[TensorMeta]) -> bytes:
        key = tuple(metadata)
        if key not in self._parts:
            if len(self._parts) >= MAX_LAYOUTS:
                self._parts.clear()
            entries = [FlattenedTensorMetadata.of(m) for m in metadata]
            self._parts[key] = _pickle_pair("metadata", entries, memo_start=1)
        metadata_part, memo_after_metadata = self._parts[key]
        tensor_part, _ = _pickle_pair(
            "flattened_tensor", flattened_tensor, memo_start=memo_after_metadata
        )
        return b"".join(
            (
                pickle.PROTO + bytes([4]),
                pickle.EMPTY_DICT + pickle.MEMOIZE + pickle.MARK,  # memo index 0: the dict
                metadata_part,
                tensor_part,
                pickle.SETITEMS + pickle.STOP,
            )
        )


def _pickle_pair(key: str, value, memo_start: int) -> tuple[bytes, int]:
    """(the opcodes of `key`, `value` as one dict item, the memo size after them), numbering memo
    entries from `memo_start` (placeholders stand for the entries written before this part)."""
    buffer = io.BytesIO()
    pickler = _EnvelopePickler(buffer, protocol=4)
    pickler.memo = {-(i + 1): (i, None) for i in range(memo_start)}  # ids are never negative
    pickler.save(key)
    pickler.save(value)
    return buffer.getvalue(), len(pickler.memo)


def to_entry(data: bytes) -> str:
    """One `serialized_named_tensors` entry: base64 (SGLang's HTTP schema decodes it)."""
    return base64.b64encode(data).decode("ascii")


def bucket_object(flattened_tensor, metadata: list[TensorMeta]) -> dict:
    """The object SGLang's flattened-bucket loader reads."""
    return {
        "flattened_tensor": flattened_tensor,
        "metadata": [FlattenedTensorMetadata.of(m) for m in metadata],
    }


class SharedTensorBucket(KeptHostBucket):
    """Learner side, CPU: a flattened bucket (SGLang's unpadded layout) in torch's file-system
    shared memory, kept and refilled push after push; `adopt` makes the parameters live in it.

    `entries(n)`: the `serialized_named_tensors` list for an engine with n TP ranks. The bytes are
    the same every push while the layout is (the storage's shm name does not change), so they are
    pickled once; each entry takes one reference on the shm file, dropped by the receiver once it
    mapped it (torch's `rebuild_storage_filename`), as a fresh ForkingPickler dump would. The
    file is unlinked when the learner and every engine have dropped it (an engine keeps its last
    mapping: torch's receiver cache then maps nothing on the next push); torch's shm manager
    unlinks what is left when they exit.
    """

    def __init__(self, named_tensors, values=None, *, dtype=None, capacity_bytes: int = 0) -> None:
        """values: None, or an iterator of (name, tensor) streamed into the layout of
        `named_tensors` (descriptions; `KeptHostBucket._fill`). dtype: None, or the torch dtype
        floating tensors are sent in (cast by the copy; the metadata names it). capacity_bytes:
        the least size of the shared file (a slot later refilled with larger buckets)."""
        torch = _torch()
        named_tensors = list(named_tensors)
        if not named_tensors:
            raise ValueError("cannot share an empty list of tensors")
        self.cast = dtype
        nbytes = max(self._bytes_of(named_tensors), capacity_bytes)
        storage = torch.UntypedStorage._new_using_filename_cpu(max(nbytes, 1))
        self._flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._adopted = None
        self._pickled: tuple[tuple, bytes] | None = None
        self._fill(named_tensors, values)

    def _align_of(self, planned: list) -> int:
        return layout_align(t.dtype for _, t in planned)  # SGLang's unpadded layout for one dtype

    @property
    def shm_handle(self) -> str:
        """The /dev/shm name of the bucket's file (e.g. "/torch_123_456_0")."""
        return self._flat.untyped_storage()._share_filename_cpu_()[1].decode()

    def _buffer(self, nbytes: int):
        return self._flat[:nbytes]

    def _capacity(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def _free(self) -> None:
        self._flat, self._pickled = None, None

    def entries(self, count: int = 1) -> list[str]:
        """`count` base64 entries of SGLang's envelope for the current contents (one per TP rank)."""
        if self._flat is None:
            raise ValueError("the bucket is closed")
        key = (self.nbytes, tuple(self.metadata))
        if self._pickled is None or self._pickled[0] != key:
            data = to_entry(serialize(bucket_object(self._flat[: self.nbytes], self.metadata)))
            self._flat.untyped_storage()._shared_decref()  # the pickle's reference: entries take their own
            self._pickled = (key, data)
        for _ in range(count):
            self._flat.untyped_storage()._shared_incref()
        return [self._pickled[1]] * count
