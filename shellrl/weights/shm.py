"""Shared-memory transport of a flattened bucket (CPU, same host; layout: `shellrl.weights.bucket`).

Learner side: `KeptHostBucket`, a bucket in host memory kept and refilled by every push, and
`SharedMemoryBucket`, one in a named POSIX segment with shellrl's JSON payload
`{"transport": "shm", "segment", "nbytes", "metadata"}` (read only by shellrl's engine; SGLang's
envelope over torch's file-system shared memory is `shellrl.weights.sglang`). Engine side:
`SharedMemoryMapping` and `open_shared_memory_bucket` / `open_shared_memory_buffer` map the
segment, copy, unmap.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory
from pathlib import Path
from typing import TYPE_CHECKING

from shellrl.weights.bucket import (
    ALIGN_BYTES,
    TensorMeta,
    _metadata_json,
    _torch,
    _views,
    describe,
    fill_from,
    flatten_into,
    plan_bucket,
    unflatten_tensors,
)

if TYPE_CHECKING:
    import torch


class KeptHostBucket:
    """Learner side: a flattened bucket in host memory that engines map, kept and refilled by every
    push. Subclasses own the memory (`_buffer`, `_capacity`, `_free`) and the payload format:
    `SharedMemoryBucket` (a named POSIX segment, shellrl's JSON payload) and
    `shellrl.weights.sglang.SharedTensorBucket` (torch's file-system shared memory, SGLang's
    envelope). `align`: the start alignment of each tensor in bytes (`plan_bucket`). `cast`: None,
    or the torch dtype floating tensors are written in (`bucket.sent_dtype`; the copy casts).
    """

    align = ALIGN_BYTES
    cast = None

    def _buffer(self, nbytes: int):
        """A 1-D uint8 tensor over the first `nbytes` bytes of the memory (a fresh view)."""
        raise NotImplementedError

    def _capacity(self) -> int:
        """Bytes the memory holds (0 once freed)."""
        raise NotImplementedError

    def _free(self) -> None:
        """Release the memory (idempotent)."""
        raise NotImplementedError

    def _fill(self, named_tensors: list, values: Iterator | None = None) -> None:
        """values: None (copy `named_tensors`), or an iterator of (name, tensor) that `fill_from`
        streams into the layout of `named_tensors` (descriptions: meta tensors will do)."""
        planned = self._planned(named_tensors)
        self.align = self._align_of(planned)
        metadata, nbytes = plan_bucket(planned, self.align)
        buffer = self._buffer(nbytes)
        if values is None:
            metadata = flatten_into(named_tensors, buffer, self.align, self.cast)
        else:
            fill_from(metadata, values, buffer)
        self.metadata, self.nbytes = metadata, nbytes
        del buffer  # no exported view may outlive the memory (close() unmaps)

    def _planned(self, named_tensors: list) -> list:
        """The tensors as they are laid out: their descriptions in `cast` (themselves without)."""
        return named_tensors if self.cast is None else describe(named_tensors, self.cast)

    def _align_of(self, planned: list) -> int:
        """The start alignment of a layout of `planned` (subclasses may pick it per layout)."""
        return self.align

    def _bytes_of(self, named_tensors: list) -> int:
        planned = self._planned(named_tensors)
        return plan_bucket(planned, self._align_of(planned))[1]

    def fits(self, named_tensors: list) -> bool:
        """The tensors (or their descriptions) fit the memory in this bucket's layout."""
        return self._bytes_of(named_tensors) <= self._capacity()

    @property
    def capacity_bytes(self) -> int:
        """Bytes of memory this bucket holds (0 once closed)."""
        return self._capacity()

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

    def refill(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], values: Iterator | None = None
    ) -> KeptHostBucket:
        """Write new tensors into the same segment: its pages are mapped already, so this is a plain
        memcpy (a fresh segment pays a page fault per 4 KiB); nothing at all when they are the adopted
        parameters (`adopt`). Call it only after every engine has read the previous contents (its
        update call returned). values: stream the tensors from this iterator of (name, tensor)
        into the layout of `named_tensors` (descriptions; see `_fill`). Raises ValueError if they
        do not fit (before anything is taken from `values`) or a streamed tensor differs from its
        slot."""
        named_tensors = list(named_tensors)
        if values is None and self._holds([t for _, t in named_tensors]):
            return self
        self._release_adopted()
        nbytes = self._bytes_of(named_tensors)
        if nbytes > self._capacity():
            raise ValueError(f"{nbytes} bytes do not fit the segment ({self._capacity()} bytes)")
        self._fill(named_tensors, values)
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
