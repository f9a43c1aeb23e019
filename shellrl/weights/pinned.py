"""A page-locked shared-memory weight bucket for GPUs without peer access (`PinnedHostBucket`,
learner side): the GPU model is flattened on its GPU and copied down in one DMA copy; the engine
reads the segment as an ordinary "shm" payload. The CUDA IPC bucket is in `shellrl.weights.gpu`,
the layout in `shellrl.weights.bucket`.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

from shellrl.weights.bucket import _metadata_json, _torch, flatten_into, plan_bucket
from shellrl.weights.gpu import CudaIpcBucket

if TYPE_CHECKING:
    import torch


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
            self.pinned = (
                int(cudart.cudaHostRegister(self._host.data_ptr(), self._host.numel(), 0)) == 0
            )
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
            host[:nbytes].copy_(
                self._source[:nbytes]
            )  # synchronous: the bytes are on the host after this
        else:
            flatten_into(named_tensors, host)
        return json.dumps(
            {
                "transport": "shm",
                "segment": self.name,
                "nbytes": nbytes,
                "metadata": _metadata_json(metadata),
            }
        )

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
