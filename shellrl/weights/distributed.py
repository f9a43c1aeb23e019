"""The NCCL/gloo weight path, both sides: SGLang 0.5.23's `init_weights_update_group`,
`update_weights_from_distributed` and `destroy_weights_update_group`.

A weight-update group is a torch process group beside any default one: rank 0 is the learner (the
broadcast source), an engine's TP ranks are `rank_offset + tp_rank`, and the ranks meet at
`tcp://master_address:master_port`, a TCPStore the learner serves, under keys prefixed with the
group's name (SGLang's `init_custom_process_group`, sglang/srt/utils/common.py, itself torch's
`init_process_group` for a second group). shellrl makes one group per engine, so a dead engine
breaks only its own group. Backend: gloo for CPU tensors, NCCL for CUDA ones.

One update: the learner sends (names, dtypes, shapes) over HTTP; the receiver allocates one
flattened bucket in SGLang's unpadded layout (`FlattenedTensorBucket.empty`: each tensor right
after the previous; a start that is not a multiple of its element size is refused) and receives
it by ONE broadcast from rank 0 (`load_format: "flattened_bucket"`).

Deadlines: every group carries torch's timeout (rendezvous and each collective), and callers run
each blocking step on a worker thread under a watchdog (`weight_sync`, the engine's runtime), so a
peer that never joins, dies or freezes costs at most the deadline, never a hang. A group whose
collective failed is destroyed: its peers' state is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from shellrl.weights.bucket import DTYPE_NAMES, TensorMeta, _torch
from shellrl.weights.shm import KeptHostBucket

if TYPE_CHECKING:
    import torch

BACKENDS = ("gloo", "nccl")


class GroupError(ValueError):
    """A bad group request or a failed collective; `field` names the request field, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def init_custom_process_group(
    backend: str,
    *,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
    init_method: str | None = None,
    store=None,
):
    """A process group outside torch's default one (SGLang's `init_custom_process_group`, same key
    layout: the store is prefixed with `group_name`). Give `init_method` ("tcp://host:port", as an
    engine does) or a `store` (the learner's own TCPStore server, prefixed here). Blocks until
    every rank joined or `timeout_s` passed (RuntimeError / DistStoreError then)."""
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy(pg) -> None:
    """Destroy a group made by init_custom_process_group (errors ignored: it may be broken), and
    free it while the interpreter is alive (shellrl.process_groups.leave)."""
    from shellrl.process_groups import leave

    leave(pg)


def bucket_layout(names: list, dtypes: list, shapes: list) -> tuple[list[TensorMeta], int]:
    """SGLang's receive layout (`FlattenedTensorBucket.empty`) for these tensors: (metadata, bytes).
    Raises GroupError naming the field: lengths differ, a dtype outside DTYPE_NAMES, a negative or
    non-integer dimension, a start that is not a multiple of its element size, nothing at all."""
    torch = _torch()
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise GroupError("names, dtypes and shapes must be lists", "names")
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise GroupError(
            f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must be "
            "non-empty and of one length",
            "names",
        )
    metadata, offset = [], 0
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        dtype = str(dtype).removeprefix("torch.")
        if dtype not in DTYPE_NAMES:
            raise GroupError(
                f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPE_NAMES)})", f"dtypes[{i}]"
            )
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise GroupError(f"{shape!r} is not a list of non-negative integers", f"shapes[{i}]")
        itemsize = getattr(torch, dtype).itemsize
        if offset % itemsize:
            raise GroupError(
                f"{name}: byte offset {offset} is not a multiple of {dtype}'s size", f"dtypes[{i}]"
            )
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        metadata.append(TensorMeta(str(name), dtype, tuple(shape), offset, offset + nbytes, nbytes))
        offset += nbytes
    return metadata, offset


def receive_bucket(pg, flat: torch.Tensor) -> torch.Tensor:
    """Rank != 0: fill `flat` (the flattened bucket, uint8 [nbytes]) by one broadcast from rank 0 of
    `pg`; returns it. Raises what the collective raises (torch's timeout, a peer gone)."""
    import torch.distributed as dist

    dist.broadcast(flat, src=0, group=pg)
    return flat


@dataclass
class SenderGroup:
    """Learner side of one engine's group: the TCPStore server (port chosen by the OS) and the
    process group once joined (`join`, blocking)."""

    name: str
    world_size: int
    backend: str
    timeout_s: float
    store: object = field(default=None, repr=False)
    pg: object = None

    def __post_init__(self) -> None:
        from torch.distributed import TCPStore

        if self.backend not in BACKENDS:
            raise GroupError(f"backend must be one of {BACKENDS}", "backend")
        self.store = TCPStore(
            "0.0.0.0",
            0,
            self.world_size,
            is_master=True,
            timeout=timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )

    @property
    def port(self) -> int:
        return self.store.port

    def join(self) -> None:
        """Blocking: rank 0's side of the rendezvous (until every rank joined or the timeout)."""
        self.pg = init_custom_process_group(
            self.backend,
            world_size=self.world_size,
            rank=0,
            group_name=self.name,
            timeout_s=self.timeout_s,
            store=self.store,
        )

    def broadcast(self, flat) -> None:
        """Blocking: broadcast a flattened bucket (uint8, on the backend's device) to the group."""
        import torch.distributed as dist

        dist.broadcast(flat, src=0, group=self.pg)

    def close(self) -> None:
        if self.pg is not None:
            destroy(self.pg)
        self.pg = self.store = None


def request_fields(named_tensors: list) -> dict:
    """The tensor fields of `update_weights_from_distributed` for these tensors, in order."""
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
    }


class ReceiverGroups:
    """Engine side: the live weight-update groups by name (this engine is one TP rank, `tp_size` 1).

    `init`, `receive` block (run them on a worker thread); `check_init` validates a request first
    so a route can answer 400 at once. A collective that fails destroys its group.
    """

    def __init__(self, device, timeout_s: float, tp_size: int = 1) -> None:
        import threading

        self.device, self.timeout_s, self.tp_size = device, timeout_s, tp_size
        self._groups: dict[str, object] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # each group's receive bucket, reused
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self._groups)

    def check_init(
        self,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        reserve: bool = False,
    ) -> None:
        """GroupError naming the field: an empty or live group name, an unknown backend (or NCCL
        on a CPU engine), a rank offset < 1 (rank 0 is the sender), a world size that does not
        hold this engine's ranks. reserve: also hold the name (one init per name at a time)."""
        if not group_name:
            raise GroupError("must not be empty", "group_name")
        if backend not in BACKENDS:
            raise GroupError(f"{backend!r} is not one of {BACKENDS}", "backend")
        if backend == "nccl" and _torch().device(self.device).type != "cuda":
            raise GroupError(
                "nccl needs a CUDA engine; this engine runs on CPU (use gloo)", "backend"
            )
        if rank_offset < 1:
            raise GroupError("must be >= 1 (rank 0 is the learner)", "rank_offset")
        if world_size < rank_offset + self.tp_size:
            raise GroupError(
                f"{world_size} does not hold ranks {rank_offset}..{rank_offset + self.tp_size - 1} "
                f"of this engine (tp_size {self.tp_size})",
                "world_size",
            )
        with self._lock:
            if group_name in self._groups or group_name in self._pending:
                raise GroupError(
                    f"a group named {group_name!r} is live; destroy it first", "group_name"
                )
            if reserve:
                self._pending.add(group_name)

    def init(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the group as rank `rank_offset` (blocking, up to the timeout). GroupError on a bad
        request (see check_init) or when the rendezvous fails; nothing is kept then."""
        self.check_init(rank_offset, world_size, group_name, backend, reserve=True)
        try:
            pg = init_custom_process_group(
                backend,
                init_method=f"tcp://{master_address}:{int(master_port)}",
                world_size=world_size,
                rank=rank_offset,
                group_name=group_name,
                timeout_s=self.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 (rendezvous failures come as several torch types)
            with self._lock:
                self._pending.discard(group_name)
            raise GroupError(f"could not join the group: {type(exc).__name__}: {exc}") from exc
        with self._lock:
            self._pending.discard(group_name)
            self._groups[group_name] = pg

    def receive(
        self, group_name: str, names: list, dtypes: list, shapes: list, load_format: str | None
    ) -> tuple[torch.Tensor, list[TensorMeta]]:
        """The broadcast bucket (blocking): (flattened uint8 tensor, metadata). GroupError for an
        unknown group, a bad layout (the group is destroyed: the sender's broadcast then fails at
        once instead of at its timeout) or a failed collective (the group is destroyed)."""
        pg = self._groups.get(group_name)
        if pg is None:
            raise GroupError(
                f"no live group named {group_name!r} (live: {self.names()}); call "
                "init_weights_update_group first",
                "group_name",
            )
        try:
            if load_format not in ("flattened_bucket", None):
                raise GroupError(
                    f"{load_format!r} is not supported (use 'flattened_bucket')", "load_format"
                )
            metadata, nbytes = bucket_layout(names, dtypes, shapes)
            if load_format == "flattened_bucket":
                kept = self._buffers.get(group_name)
                if (
                    kept is None or kept.numel() < nbytes
                ):  # reused: no allocation, no page faults per push
                    kept = self._buffers[group_name] = _torch().empty(
                        nbytes, dtype=_torch().uint8, device=self.device
                    )
                return receive_bucket(pg, kept[:nbytes]), metadata
            return self._receive_each(pg, metadata, nbytes), metadata
        except GroupError:
            self.destroy(group_name)
            raise
        except Exception as exc:  # noqa: BLE001 (torch's timeout, a peer gone)
            self.destroy(group_name)
            raise GroupError(
                f"broadcast failed, group {group_name!r} destroyed: {type(exc).__name__}: {exc}"
            ) from exc

    def _receive_each(self, pg, metadata: list[TensorMeta], nbytes: int):
        """load_format null: one broadcast per tensor (SGLang's per-tensor path), into one bucket."""
        import torch.distributed as dist

        torch = _torch()
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        works = [
            dist.broadcast(
                flat[m.start_idx : m.end_idx].view(getattr(torch, m.dtype)),
                src=0,
                group=pg,
                async_op=True,
            )
            for m in metadata
        ]
        for work in works:
            work.wait()
        return flat

    def destroy(self, group_name: str) -> None:
        """GroupError when no such group is live."""
        with self._lock:
            pg = self._groups.pop(group_name, None)
            self._buffers.pop(group_name, None)
        if pg is None:
            raise GroupError(f"no live group named {group_name!r}", "group_name")
        destroy(pg)

    def close(self) -> None:
        for name in self.names():
            self.destroy(name)


class FlatBucket(KeptHostBucket):
    """Learner side: the kept flattened bucket a group broadcasts (SGLang's unpadded layout), on
    the model's device, refilled by every push; on CPU the parameters may live in it (`adopt`)."""

    align = 1

    def __init__(self, named_tensors, device, values=None, *, dtype=None) -> None:
        """values: None, or an iterator of (name, tensor) streamed into the layout of
        `named_tensors` (descriptions; `KeptHostBucket._fill`). dtype: None, or the torch dtype
        floating tensors are written in (the copy casts; the engine's dtype)."""
        torch = _torch()
        named_tensors = list(named_tensors)
        self.cast = dtype
        nbytes = self._bytes_of(named_tensors)
        self._flat = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        self._adopted = None
        self._fill(named_tensors, values)

    def _buffer(self, nbytes: int):
        return self._flat[:nbytes]

    def _capacity(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def _free(self) -> None:
        self._flat = None

    @property
    def tensor(self):
        """The used bytes: uint8 [nbytes] (what the group broadcasts)."""
        return self._flat[: self.nbytes]
