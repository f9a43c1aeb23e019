"""Receiver side of SGLang's envelope (`shellrl.weights.sglang`): an unpickler that never unpickles
arbitrary objects, and the validated bucket it reads.

`deserialize` is SGLang's `MultiprocessingSerializer.deserialize` under an allow-list that mirrors
SGLang 0.5.23's `SafeUnpickler.ALLOWED_GLOBALS`: any other global (`os.system`, ...) raises before
anything is called. Three entries of SGLang's list are refused with a reason (`_REFUSED`: they make
the receiver fetch a descriptor or socket from an address named in the payload); SGLang's own
classes resolve to shellrl's stand-ins; torch's `rebuild_storage_filename` runs only after its
names and size are checked. `decode_flattened_bucket` / `decode_named_tensors` validate what came
out; every error is an `EnvelopeError` naming the field (the engine answers 400 with it).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import re
from typing import TYPE_CHECKING

from shellrl.weights.bucket import DTYPE_NAMES, TensorMeta, _torch
from shellrl.weights.sglang import (
    PATCH_TORCH_MODULE,
    TENSOR_BUCKET_MODULE,
    FlattenedTensorMetadata,
    rebuild_cuda_tensor_by_uuid,
)

if TYPE_CHECKING:
    import torch

SHM_REFCOUNT_BYTES = 64  # torch's shm files carry a reference count after the data (MapAllocator)


class EnvelopeError(ValueError):
    """A payload that is not a valid SGLang envelope; `field` names where (for a 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (sglang/srt/utils/common.py), module: names, less
# `_REFUSED` and SGLang's own data containers (GenerateReqInput, ...: no use here); SGLang's weight
# classes resolve to `_STAND_INS`. {T}: each of _TENSOR_TYPES.
_TENSOR_TYPES = "BFloat16 Bool Byte Char Double Float Half Int Long Short".split()
_ALLOWED_TABLE = """
builtins: bool bytearray bytes complex dict float frozenset int list range set slice str tuple
collections: OrderedDict defaultdict deque Counter
copyreg: __newobj__ __newobj_ex__
functools: partial
itertools: chain repeat
multiprocessing.reduction: _rebuild_partial
types: SimpleNamespace
_codecs: encode
torch: Tensor Size device dtype UntypedStorage {T}Tensor {T}Storage ComplexDoubleStorage ComplexFloatStorage
  QInt32Storage QInt8Storage QUInt2x4Storage QUInt4x2Storage QUInt8Storage
  per_tensor_affine per_tensor_symmetric per_channel_affine per_channel_symmetric per_channel_affine_float_qparams
  bcomplex32 bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32
  complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2
  float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 long
  qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64
  uint7 uint8
torch.cuda: {T}Tensor {T}Storage ComplexDoubleStorage ComplexFloatStorage
torch.sparse: BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor
  ShortTensor
torch.cuda.sparse: BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor IntTensor
  LongTensor ShortTensor
torch.nn.parameter: Parameter
torch.serialization: _get_layout
torch._tensor: _rebuild_from_type_v2
torch.storage: UntypedStorage _UntypedStorage TypedStorage
torch._utils: _rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_parameter
  _rebuild_parameter_with_state _rebuild_qtensor _rebuild_sparse_tensor _rebuild_meta_tensor_no_storage
  _rebuild_wrapper_subclass _rebuild_device_tensor_from_numpy _rebuild_device_tensor_from_cpu_tensor
torch.multiprocessing.reductions: rebuild_tensor rebuild_meta_tensor rebuild_cuda_tensor
  rebuild_nested_tensor rebuild_sparse_coo_tensor rebuild_sparse_compressed_tensor rebuild_storage_filename
  rebuild_storage_empty rebuild_typed_storage rebuild_typed_storage_child
"""


def _parse_table(text: str) -> frozenset[tuple[str, str]]:
    pairs, module = set(), None
    for line in text.strip().splitlines():
        if not line.startswith(" "):
            module, line = line.split(":", 1)
        for name in line.split():
            names = [name.replace("{T}", t) for t in _TENSOR_TYPES] if "{T}" in name else [name]
            pairs.update((module, n) for n in names)
    return frozenset(pairs)


ALLOWED_GLOBALS = _parse_table(_ALLOWED_TABLE)
_REFUSED = {
    (
        "torch.multiprocessing.reductions",
        "rebuild_storage_fd",
    ): "CPU tensors shared by file descriptor (torch's default strategy) cannot be opened by an unrelated "
    "process; share them with the file_system strategy",
    ("multiprocessing.resource_sharer", "DupFd"): "file descriptors are not taken from the network",
    ("multiprocessing.reduction", "_rebuild_socket"): "sockets are not taken from the network",
}
_SHM_HANDLE = re.compile(rb"^/torch_\d+_\d+(_\d+)?$")
_SHM_MANAGER = re.compile(rb"^/[^\0]*/torch-shm-dir-[^/\0]+/manager\.sock$")


def _safe_load_torch_storage(data: bytes):
    """SGLang's replacement for `torch.storage._load_from_bytes` (a nested unrestricted torch.load)."""
    storage = _torch().load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (_torch().TypedStorage, _torch().UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def _checked_rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    """torch's `rebuild_storage_filename` once the names and size are checked: torch would map any
    /dev/shm file named, and grow a file shorter than `size`."""
    from torch.multiprocessing.reductions import rebuild_storage_filename

    if not (isinstance(manager, bytes) and _SHM_MANAGER.match(manager)):
        raise pickle.UnpicklingError(f"not a torch shm manager socket: {manager!r}")
    if not (isinstance(handle, bytes) and _SHM_HANDLE.match(handle)) or not isinstance(size, int):
        raise pickle.UnpicklingError(f"not a torch shm file: {handle!r}")
    try:
        file_bytes = os.stat(b"/dev/shm" + handle).st_size
    except FileNotFoundError:
        raise pickle.UnpicklingError(
            f"shared-memory file {handle.decode()} does not exist (is the sender on "
            "this host, and still holding it?)"
        ) from None
    nbytes = size * (1 if dtype is None else dtype.itemsize)
    if not 0 <= nbytes <= file_bytes - SHM_REFCOUNT_BYTES:
        raise pickle.UnpicklingError(
            f"{nbytes} bytes claimed of shared-memory file {handle.decode()} ({file_bytes} bytes)"
        )
    return rebuild_storage_filename(cls, manager, handle, size, dtype)


_STAND_INS = {
    ("torch.storage", "_load_from_bytes"): _safe_load_torch_storage,
    (
        "torch.multiprocessing.reductions",
        "rebuild_storage_filename",
    ): _checked_rebuild_storage_filename,
    (TENSOR_BUCKET_MODULE, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    (PATCH_TORCH_MODULE, "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor_by_uuid,
}


class SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals of SGLang's SafeUnpickler allow-list (less `_REFUSED`), and
    SGLang's own classes to the stand-ins above; anything else raises UnpicklingError."""

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _STAND_INS:
            return _STAND_INS[key]
        if key in _REFUSED:
            raise pickle.UnpicklingError(f"{module}.{name}: {_REFUSED[key]}")
        if key not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"blocked global {module}.{name} (not on the allow-list)")
        return super().find_class(module, name)


def deserialize(entry, field: str = "serialized_named_tensors[0]"):
    """`MultiprocessingSerializer.deserialize` of one entry (base64 str, or the raw bytes) under
    the allow-list. Raises EnvelopeError naming `field` for bad base64 or a refused pickle."""
    if isinstance(entry, str):
        try:
            entry = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError):
            raise EnvelopeError(field, "expected base64-encoded bytes") from None
    if not isinstance(entry, bytes):
        raise EnvelopeError(field, f"expected a base64 string, got {type(entry).__name__}")
    try:
        return SafeUnpickler(io.BytesIO(entry)).load()
    except EnvelopeError:
        raise
    except Exception as exc:  # noqa: BLE001 (any failure of an untrusted pickle is the sender's)
        raise EnvelopeError(
            field,
            "cannot unpickle under the allow-list (arbitrary objects are never "
            f"unpickled): {type(exc).__name__}: {exc}",
        ) from None


def _meta(meta, field: str, buffer_bytes: int) -> TensorMeta:
    torch = _torch()
    if not isinstance(meta, FlattenedTensorMetadata):
        raise EnvelopeError(field, f"expected FlattenedTensorMetadata, got {type(meta).__name__}")
    dtype = getattr(meta, "dtype", None)
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None
    if name not in DTYPE_NAMES:
        raise EnvelopeError(
            f"{field}.dtype", f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPE_NAMES)})"
        )
    try:
        out = TensorMeta.from_json(
            {
                "name": meta.name,
                "dtype": name,
                "shape": list(meta.shape),
                "start_idx": meta.start_idx,
                "end_idx": meta.end_idx,
                "numel": meta.numel,
            }
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise EnvelopeError(field, str(exc)) from None
    if out.end_idx > buffer_bytes:
        raise EnvelopeError(
            f"{field}.end_idx",
            f"bytes [{out.start_idx}, {out.end_idx}) overrun the "
            f"{buffer_bytes}-byte flattened_tensor",
        )
    return out


def decode_flattened_bucket(
    obj, field: str = "serialized_named_tensors[0]"
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """(flattened uint8 tensor, validated metadata) of a deserialized flattened bucket.
    Raises EnvelopeError naming the field: a missing key, a buffer that is not 1-D uint8, a
    dtype outside DTYPE_NAMES, a byte range that does not hold its shape or overruns the buffer."""
    torch = _torch()
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
        raise EnvelopeError(
            field,
            "expected {'flattened_tensor': uint8 tensor, 'metadata': [...]} "
            "(load_format 'flattened_bucket')",
        )
    buffer, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise EnvelopeError(f"{field}.flattened_tensor", "expected a 1-D uint8 tensor")
    if not isinstance(metadata, list) or not metadata:
        raise EnvelopeError(
            f"{field}.metadata", "expected a non-empty list of FlattenedTensorMetadata"
        )
    return buffer, [
        _meta(m, f"{field}.metadata[{i}]", buffer.numel()) for i, m in enumerate(metadata)
    ]


def decode_named_tensors(
    obj, field: str = "serialized_named_tensors[0]"
) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] of a deserialized `load_format: null` payload; EnvelopeError otherwise."""
    torch = _torch()
    if (
        not isinstance(obj, list)
        or not obj
        or not all(
            isinstance(p, tuple)
            and len(p) == 2
            and isinstance(p[0], str)
            and isinstance(p[1], torch.Tensor)
            for p in obj
        )
    ):
        raise EnvelopeError(field, "expected a non-empty list of (name, tensor) (load_format null)")
    return obj
