"""The learner side of the weight transports: where one version's weights are written for the
engines to read, and the payload that tells an engine where to find them.

Transports (DESIGN.md section 6, shellrl.weights.bucket): shared memory when the model is on
CPU and the engine on this host; CUDA IPC of a bucket on the GPU when the model is on a GPU of
this host; safetensors on disk (`update_weights_from_disk`) otherwise. The shared-memory segments
and CUDA IPC buckets are kept and refilled push after push (no page faults, a stable IPC handle;
with share_parameters the shm segment holds the parameters themselves, so a refill copies nothing);
after a push that an engine abandoned at the deadline they are dropped (`close`) and made anew,
because that engine may still read them. weight_sync.py sends the payloads to the engines.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from shellrl.weights import bucket as wt
from shellrl.weights import disk as wtd
from shellrl.weights import gpu as wtg

BUCKET_BYTES = 1 << 30  # shm: segments of at most this size. cuda_ipc: one bucket (the kept buckets hold
# the whole model however it is split, so a split only adds update calls: 15 for a 7B model in bf16)
TRANSPORTS = ("shm", "cuda_ipc", "disk")


def choose_transport(setting: str, device: torch.device, urls: list[str]) -> str:
    """'auto' -> cuda_ipc (model on GPU, engines on this host), shm (CPU, engines on this host) or disk."""
    if setting != "auto":
        return setting
    local = all(_is_local(u) for u in urls)
    if not local:
        return "disk"
    return "cuda_ipc" if device.type == "cuda" else "shm"


def _is_local(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1", socket.gethostname())


class WeightStaging:
    """Writes a version's weights once for every engine, into buffers kept across pushes.

    transport: "shm", "cuda_ipc" or "disk" (ValueError otherwise; resolve "auto" with
    `choose_transport` first). sync_dir: the disk transport's safetensors (one `v<version>`
    directory per push, the newest two kept). bucket_bytes: shm segment size bound.
    engine_device: the engines' CUDA device for cuda_ipc (None: the model's device).
    share_parameters: shm only; the model's parameters are moved into the kept segments
    (`SharedMemoryBucket.adopt`), so a push writes nothing on the learner side: the optimizer
    already wrote the weights there. After a push an engine abandoned, they move back out
    (close) and into fresh segments at the next push.
    """

    def __init__(self, transport: str, sync_dir: str | Path, *, bucket_bytes: int = BUCKET_BYTES,
                 engine_device: str | None = None, share_parameters: bool = False) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be shm, cuda_ipc or disk (resolve 'auto' first); "
                             f"got {transport!r}")
        self.transport, self.sync_dir, self.bucket_bytes = transport, Path(sync_dir), bucket_bytes
        self.engine_device, self.share_parameters = engine_device, share_parameters
        self._kept: list = []  # SharedMemoryBucket or CudaIpcBucket per bucket, refilled by every push
        if transport == "shm":
            remove_orphan_segments()

    def close(self) -> None:
        """Release the kept buckets (unlink the shared-memory segments)."""
        for bucket in self._kept:
            bucket.close()
        self._kept = []

    def prepare(self, model: torch.nn.Module, version: int) -> dict:
        """Write the weights once for every engine (blocking: disk and shm run it in a thread; cuda_ipc
        only enqueues GPU copies and runs it on the event loop). Returns {"model_path": directory}
        (disk) or {"payloads": [JSON string per bucket]} (shm, cuda_ipc)."""
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        if self.transport == "disk":
            directory = self.sync_dir / f"v{version:08d}"
            wtd.save_safetensors_dir(named, directory)
            for old in sorted(self.sync_dir.glob("v*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)
            return {"model_path": str(directory.resolve())}
        buckets = split_buckets(named, self.bucket_bytes) if self.transport == "shm" else [named]
        if len(self._kept) != len(buckets):
            self.close()
        if self.transport == "shm":
            payloads = []
            for i, bucket in enumerate(buckets):
                try:
                    kept = self._kept[i].refill(bucket) if i < len(self._kept) else None
                except ValueError:  # the tensors grew: a new segment
                    self._kept[i].close()
                    kept = None
                if kept is None:
                    kept = wt.SharedMemoryBucket(bucket)
                    if self.share_parameters:
                        params = dict(model.named_parameters())
                        kept.adopt([params[name] for name, _ in bucket])
                    self._kept[i:i + 1] = [kept]
                payloads.append(kept.payload())
            return {"payloads": payloads}
        device = self.engine_device or named[0][1].device
        if not self._kept:
            self._kept = [wtg.CudaIpcBucket(device) for _ in buckets]
        # sync=False: the copies are enqueued, not awaited; the engine waits on the bucket's ready event
        return {"payloads": [kept.fill(bucket, sync=False) for kept, bucket in zip(self._kept, buckets)]}


def split_buckets(named: list[tuple[str, torch.Tensor]],
                  bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split named tensors, in order, into buckets of at most bucket_bytes (a larger tensor alone)."""
    out, current, size = [], [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes + wt.ALIGN_BYTES
    if current:
        out.append(current)
    return out


def remove_orphan_segments(prefix: str = "shellrl_w", directory: Path = Path("/dev/shm")) -> int:
    """Unlink shared-memory segments `<prefix>_<pid>_<token>` whose creating process is gone (a
    learner killed with SIGKILL leaves its kept segment behind). Returns how many were removed."""
    removed = 0
    pattern = re.compile(rf"^{re.escape(prefix)}_(\d+)_[0-9a-f]+$")
    for path in directory.glob(f"{prefix}_*") if directory.is_dir() else ():
        match = pattern.match(path.name)
        if not match or _alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
