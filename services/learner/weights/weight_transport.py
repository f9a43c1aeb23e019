"""The learner side of the weight transports: where one version's weights are written for the
engines to read, and the payload that tells an engine where to find them.

Transports (DESIGN.md section 6, shellrl.weights):
* shm: SGLang's envelope for `/update_weights_from_tensor` (`shellrl.weights.sglang`) over a
  flattened bucket in torch's file-system shared memory; any engine on this host, SGLang or ours.
* cuda_ipc: SGLang's envelope over buckets on the engine's GPU, the CUDA tensor shared by torch's
  IPC reduction with the GPU named by UUID (`CudaIpcBucket.entries`), as SGLang's own client
  sends it: SGLang on a GPU or shellrl's engine on a GPU. Streamed: the model is split into
  buckets of at most `bucket_bytes` (in the engine's dtype when `dtype` is set: the copy into the
  bucket casts), which pass through two kept slots (`bucket_stream.BucketStream`: bucket i is
  filled into slot i % 2 when an engine first asks for it, and the slot takes bucket i+2 only
  once every engine answered bucket i), so the learner adds at most two buckets to the engine's
  GPU, never the model (`resident_bytes`; a tensor over the budget makes its bucket larger).
* distributed: one broadcast per bucket through a torch process group per engine (gloo on CPU,
  NCCL on GPU; `shellrl.weights.distributed`), for engines on other GPUs or hosts; in the
  engines' dtype (`dtype`: the copy casts, so a bf16 engine receives half the bytes of float32
  weights) it streams through the two slots as cuda_ipc does (a slot's broadcast is done once
  every engine answered its update call).
* disk: safetensors (`update_weights_from_disk`) in a directory the engines can read.
shm and distributed stream through the same two slots when their parameters are not shared
(share_parameters off, or a cast: a bf16 bucket cannot hold float32 parameters); with share_parameters the model's
parameters live in one kept bucket per split and a push adds and copies nothing.
The buckets are kept and refilled push after push (no page faults, a stable IPC handle; with
share_parameters the CPU bucket holds the parameters themselves, so a refill copies nothing);
after a push that an engine abandoned they are dropped (`close`) and made anew, because that
engine may still read them. A sharded learner (several ranks, FSDP2) pushes its `FullWeights`
into the same buckets and layouts, streamed: the buckets are planned from the parameters' global
shapes and each parameter is gathered, copied into its slot and dropped before the next, so rank 0
holds the buckets plus about one gathered parameter, never the full model twice.
weight_sync.py sends the payloads to the engines; the distributed transport's process groups are
in engine_groups.py.
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from urllib.parse import urlparse

import torch

from services.learner.pids import pid_alive
from services.learner.sharding import FullWeights
from services.learner.weights.bucket_stream import SLOTS, BucketStream
from shellrl.weights import bucket as wt
from shellrl.weights import disk as wtd
from shellrl.weights import distributed as wdist
from shellrl.weights import gpu as wtg
from shellrl.weights import sglang as wsg

BUCKET_BYTES = 512 << 20  # buckets of at most this size (slime and verl's default); a larger
# tensor alone
TRANSPORTS = ("shm", "cuda_ipc", "distributed", "disk")
_OVERSIZE_REPORTED: set[str] = set()  # tensors split_buckets has said are larger than a bucket
log = logging.getLogger(__name__)


def choose_transport(setting: str, device: torch.device, urls: list[str]) -> str:
    """By topology: 'auto' -> cuda_ipc (model on GPU, engines on this host), shm (CPU, engines on
    this host) or disk (an engine elsewhere). `engine_transport` refines it by what an engine says."""
    if setting != "auto":
        return setting
    local = all(is_local(u) for u in urls)
    if not local:
        return "disk"
    return "cuda_ipc" if device.type == "cuda" else "shm"


def engine_transport(transport: str, server_info: dict) -> str:
    """The transport an engine can take, from its /server_info: cuda_ipc (SGLang's envelope with a
    CUDA tensor) for an engine on a GPU, SGLang's or ours (`device`, SGLang's server argument, is
    "cuda" by default); an engine on CPU gets shm (the same envelope with a CPU tensor in shared
    memory). Other transports are kept."""
    if transport != "cuda_ipc":
        return transport
    on_gpu = str(server_info.get("device", "cuda")).startswith("cuda")
    return "cuda_ipc" if on_gpu else "shm"


def is_local(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1", socket.gethostname())


class WeightStaging:
    """Writes a version's weights once for every engine, into buffers kept across pushes.

    transport: "shm", "cuda_ipc" or "disk" (ValueError otherwise; resolve "auto" with
    `choose_transport` first). sync_dir: the disk transport's safetensors (one `v<version>`
    directory per push, the newest two kept). bucket_bytes: the most bytes of one bucket (one
    update call). engine_device: the engines' CUDA device for cuda_ipc (None: the model's
    device). share_parameters: shm and distributed on CPU; the model's parameters are moved into
    the kept buckets (`SharedMemoryBucket.adopt`), so a push writes nothing on the learner side:
    the optimizer already wrote the weights there. After a push an engine abandoned, they move
    back out (close) and into fresh segments at the next push. dtype: None, or the torch dtype
    the floating tensors are sent in (the engines' bfloat16 or float16; set by WeightSync from
    `weight_dtype.push_dtype`): cuda_ipc, shm and distributed cast while copying into the
    bucket (`casts`).
    Streamed transports (`streams`): cuda_ipc, and shm without shared parameters.
    """

    def __init__(
        self,
        transport: str,
        sync_dir: str | Path,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        engine_device: str | None = None,
        share_parameters: bool = False,
        dtype=None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {TRANSPORTS} (resolve 'auto' first); got {transport!r}"
            )
        self.transport, self.sync_dir, self.bucket_bytes = transport, Path(sync_dir), bucket_bytes
        self.engine_device, self.share_parameters = engine_device, share_parameters
        self.dtype = dtype
        # streamed: the SLOTS kept slots (CudaIpcBucket / SharedTensorBucket, None until first
        # filled); else one kept bucket per split (SharedTensorBucket / FlatBucket / CudaIpcBucket)
        self._kept: list = []
        self.stream: BucketStream | None = None  # the last push's schedule (streamed transports)
        if transport == "shm":
            remove_orphan_segments()

    def close(self) -> None:
        """Release the kept buckets (unlink the shared-memory segments, free the CUDA buffers)."""
        if self.stream is not None:
            self.stream.close()
        for bucket in self._kept:
            if bucket is not None:
                bucket.close()
        self._kept = []

    def streams(self, model: torch.nn.Module | None = None) -> bool:
        """Whether a push of `model` streams through the two slots: cuda_ipc, and shm and
        distributed unless their parameters live in the kept buckets (share_parameters without a
        cast); not a sharded model's `FullWeights` (`_prepare_streamed` keeps its own buckets)."""
        if isinstance(model, FullWeights):
            return False
        if self.transport == "cuda_ipc":
            return True
        return self.transport in ("shm", "distributed") and (
            not self.share_parameters or self.dtype is not None
        )

    def casts(self, model: torch.nn.Module | None = None) -> bool:
        """Whether a push of `model` travels in the engines' dtype (`dtype`): cuda_ipc, the
        distributed transport (a cast makes it stream through two slots) and shm without shared
        parameters; not shm with shared parameters, whose push copies nothing on the learner (the
        parameters live in the segments, float32): on CPU that is faster than a cast into slots
        (0.5B into SGLang's own loader: 9.1 s against 13.4 s at 128 MiB, at no extra memory
        either side but the engine's mapping of pages the learner holds anyway; BENCHMARKS, "The
        weight path at real sizes"), while a cast halves what a broadcast carries (8.1 -> 4.5 s).
        Not disk, not a sharded model's `FullWeights`."""
        if isinstance(model, FullWeights) or self.transport == "disk":
            return False
        return not (self.transport == "shm" and self.share_parameters)

    @property
    def resident_bytes(self) -> int:
        """Bytes the kept buckets hold now: on the engine's GPU (cuda_ipc) or in shared memory
        (shm); 0 for disk. Streamed: at most two slots (`BucketStream`)."""
        return sum(bucket.capacity_bytes for bucket in self._kept if bucket is not None)

    def bucket_count(self, model: torch.nn.Module) -> int:
        """How many update calls `prepare(model, ...)` will need (1 for disk and a sharded
        model's cuda_ipc), from the parameters' sizes alone: nothing is gathered or copied."""
        if self.transport == "disk" or (
            self.transport == "cuda_ipc" and isinstance(model, FullWeights)
        ):
            return 1
        layout = (
            model.layout()
            if isinstance(model, FullWeights)
            else [(n, p) for n, p in model.named_parameters()]
        )
        dtype = self.dtype if self.streams(model) else None
        return len(split_buckets(layout, self.bucket_bytes, dtype))

    def prepare(
        self, model: torch.nn.Module, version: int, engines: Sequence[str] | None = None
    ) -> dict:
        """Write or plan the weights once for every engine. Returns {"model_path": directory}
        (disk), {"broadcast": [(tensor fields, flattened uint8 tensor)]} (distributed),
        {"buckets": [entries(tp_size) -> serialized_named_tensors]} (shm with shared parameters)
        or, streamed (`streams`), {"buckets" (distributed: "broadcast"): [provider(tp_size) ->
        awaitable entries (distributed: awaitable (tensor fields, flattened uint8 tensor))],
        "stream": BucketStream}: nothing is copied here, bucket i is filled into its slot when the
        first of `engines` (the push's engine urls, each of which must `leave` the stream;
        ValueError without them) asks for it.
        Blocking where it copies (disk, shm with shared parameters, distributed: run it in a
        thread); the streamed plan only splits the list. model: an nn.Module, or a sharded
        model's `FullWeights` (`_prepare_streamed`)."""
        if isinstance(model, FullWeights):
            return self._prepare_streamed(model, version)
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        if self.transport == "disk":
            directory = self.sync_dir / f"v{version:08d}"
            wtd.save_safetensors_dir(named, directory)
            self._prune_sync_dir()
            return {"model_path": str(directory.resolve())}
        if self.streams(model):
            return self._prepare_stream(named, engines)
        buckets = split_buckets(named, self.bucket_bytes)
        if len(self._kept) != len(buckets) or None in self._kept:
            self.close()
        kept = [self._refilled(model, i, bucket) for i, bucket in enumerate(buckets)]
        if self.transport == "distributed":
            return {
                "broadcast": [
                    (wdist.request_fields(bucket), k.tensor) for k, bucket in zip(kept, buckets)
                ]
            }
        return {"buckets": [k.entries for k in kept]}

    def _prepare_stream(self, named: list, engines: Sequence[str] | None) -> dict:
        """The streamed plan (see `prepare`): buckets in the sent dtype, two kept slots."""
        if engines is None:
            raise ValueError("a streamed push needs its engines' urls (prepare(..., engines))")
        if len(self._kept) != SLOTS:
            self.close()
            self._kept = [None] * SLOTS
        if self.stream is not None:
            self.stream.close()
        buckets = split_buckets(named, self.bucket_bytes, self.dtype)
        self.stream = BucketStream(
            buckets,
            engines,
            self._fill_slot,
            # a memcpy on CPU; cuda_ipc (and a distributed bucket on a GPU) only enqueue copies
            in_thread=self.transport == "shm"
            or (self.transport == "distributed" and named[0][1].device.type == "cpu"),
            resident_bytes=lambda: self.resident_bytes,
        )
        key = "broadcast" if self.transport == "distributed" else "buckets"
        return {key: self.stream.providers, "stream": self.stream}

    def _fill_slot(self, slot: int, bucket: list):
        """Bucket into kept slot `slot` (made, grown, or shrunk back to the budget after an
        over-budget bucket); returns its entries(tp_size). cuda_ipc: fill(sync=False) enqueues the
        copies; each envelope entry shares the bucket with an interprocess event recorded after
        them, which the engine waits on before it reads."""
        kept = self._kept[slot]
        needed = wt.plan_bucket(wt.describe(bucket, self.dtype), 1)[1]
        if kept is not None and kept.capacity_bytes > max(self.bucket_bytes, needed):
            kept.close()  # an over-budget bucket's buffer: back to the budget
            kept = self._kept[slot] = None
            if self.transport == "cuda_ipc":
                torch.cuda.ipc_collect()  # buffers no engine maps any more are freed now
        if self.transport == "cuda_ipc":
            if kept is None:
                kept = self._kept[slot] = wtg.CudaIpcBucket(
                    self.engine_device or bucket[0][1].device
                )
            kept.fill(bucket, sync=False, dtype=self.dtype, payload=False)
            return kept.entries
        if self.transport == "distributed":
            if kept is not None and kept.fits(bucket) and kept.cast == self.dtype:
                kept.refill(bucket)
            else:
                if kept is not None:
                    kept.close()
                kept = self._kept[slot] = wdist.FlatBucket(
                    bucket, bucket[0][1].device, dtype=self.dtype
                )
            fields = wdist.request_fields(wt.describe(bucket, self.dtype))
            # one broadcast whatever the engine's TP size; the slot is read when asked for, so
            # that a slot freed by end_push is not kept alive by this push's schedule
            return lambda tp_size: (fields, kept.tensor)
        if kept is not None and kept.fits(bucket) and kept.cast == self.dtype:
            kept.refill(bucket)
        else:
            if kept is not None:
                kept.close()
            kept = self._kept[slot] = wsg.SharedTensorBucket(bucket, dtype=self.dtype)
        return kept.entries

    def end_push(self) -> None:
        """After a streamed push: every engine has left; a slot still holding an over-budget
        bucket is freed, so that the next push starts from at most two buckets of the budget."""
        if self.stream is not None:
            self.stream.close()
        for slot, kept in enumerate(self._kept):
            if kept is not None and kept.capacity_bytes > self.bucket_bytes:
                kept.close()
                self._kept[slot] = None

    def _prepare_streamed(self, weights: FullWeights, version: int) -> dict:
        """`prepare` for a sharded model, in the same buckets and layouts as the unsharded one:
        the buckets are planned from `weights.layout()` and each parameter is gathered (every
        rank joins), copied into its slot and dropped before the next, so this rank holds the
        kept buckets plus one gathered parameter, never the full model a second time. The
        parameters are shards here, so they never live in a bucket (share_parameters is not
        used). Every rank takes part in every gather even when a copy fails (`FullWeights`)."""
        layout = weights.layout()
        with closing(weights.named_parameters()) as values:  # gathered as they are consumed
            if self.transport == "disk":
                directory = self.sync_dir / f"v{version:08d}"
                wtd.save_safetensors_stream(layout, values, directory)
                self._prune_sync_dir()
                return {"model_path": str(directory.resolve())}
            buckets = (
                [layout]
                if self.transport == "cuda_ipc"
                else split_buckets(layout, self.bucket_bytes)
            )
            if len(self._kept) != len(buckets) or None in self._kept:
                self.close()
            if self.transport == "cuda_ipc":
                if not self._kept:
                    device = self.engine_device or weights.device
                    self._kept = [wtg.CudaIpcBucket(device) for _ in buckets]
                for kept, bucket in zip(self._kept, buckets):
                    kept.fill(bucket, sync=False, values=values)
                return {"buckets": [kept.entries for kept in self._kept]}
            kept = [
                self._streamed(i, bucket, values, weights.device)
                for i, bucket in enumerate(buckets)
            ]
        if self.transport == "distributed":
            return {
                "broadcast": [
                    (wdist.request_fields(bucket), k.tensor) for k, bucket in zip(kept, buckets)
                ]
            }
        return {"buckets": [k.entries for k in kept]}

    def _streamed(self, i: int, bucket: list, values, device: torch.device):
        """Kept bucket i refilled from `values` in the layout of `bucket` (descriptions), or made
        anew (and filled) when there is none or the layout no longer fits it."""
        kept = self._kept[i] if i < len(self._kept) else None
        if kept is not None and not kept.fits(bucket):
            kept.close()
            kept = None
        if kept is not None:
            return kept.refill(bucket, values)
        if self.transport == "shm":
            kept = wsg.SharedTensorBucket(bucket, values)
        else:
            kept = wdist.FlatBucket(bucket, device, values)
        self._kept[i : i + 1] = [kept]
        return kept

    def _prune_sync_dir(self) -> None:
        """Keep the newest two versions of the disk transport."""
        for old in sorted(self.sync_dir.glob("v*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)

    def _refilled(self, model: torch.nn.Module, i: int, bucket: list):
        """Kept bucket i holding `bucket` (refilled, or made anew when the tensors no longer fit)."""
        try:
            kept = self._kept[i].refill(bucket) if i < len(self._kept) else None
        except ValueError:  # the tensors grew: a new bucket
            self._kept[i].close()
            kept = None
        if kept is None:
            device = bucket[0][1].device
            kept = (
                wsg.SharedTensorBucket(bucket)
                if self.transport == "shm"
                else wdist.FlatBucket(bucket, device)
            )
            if self.share_parameters and device.type == "cpu":
                params = dict(model.named_parameters())
                kept.adopt([params[name] for name, _ in bucket])
            self._kept[i : i + 1] = [kept]
        return kept


def split_buckets(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype=None
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split named tensors, in order, into buckets of at most bucket_bytes (a larger tensor alone,
    said once in the log). dtype: None, or the dtype floating tensors are sent in (sizes count
    in it: `bucket.sent_dtype`)."""
    out, current, size = [], [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * wt.sent_dtype(tensor, dtype).itemsize
        if nbytes > bucket_bytes and name not in _OVERSIZE_REPORTED:
            _OVERSIZE_REPORTED.add(name)
            log.warning(
                "a tensor larger than the bucket budget goes in a bucket of its own",
                extra={"tensor": name, "bytes": nbytes, "bucket_bytes": bucket_bytes},
            )
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
        if not match or pid_alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed
