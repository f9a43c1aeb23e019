"""Weight updates of the engine's model: read, validate and stage new tensors; swap them in later.

Consumes the payloads of `/update_weights_from_tensor` (SGLang's envelope, unpickled only under an
allow-list: `shellrl.weights.safe_unpickle`; or shellrl's JSON: a shared-memory bucket, or a CUDA IPC
bucket on this engine's GPU), the buckets of `/update_weights_from_distributed` (received by the
runtime, `shellrl.weights.distributed`) and `/update_weights_from_disk` (safetensors directory).
Produces a `StagedWeights`: new tensors already in the model's dtype and
device, each checked against the parameter it replaces (known name, identical shape). Nothing is
touched until the scheduler calls `commit` between two decoding steps, so a bad payload leaves
the engine serving its old weights and no token is computed with half-old, half-new weights.

Where staged tensors live: two arenas (double buffering), each one contiguous buffer with every
parameter at the offsets of `plan_bucket(model parameters, layout_align(...))` (SGLang's
unpadded layout for a one-dtype model). A parameter is staged into the arena
it does not live in, and `commit` points the parameter at it (`param.data = view`, no copy). The
arenas are allocated once and reused, so after the first two updates a whole-model update costs
one copy into memory that is already mapped (a fresh allocation pays a page fault per 4 KiB,
several times the copy itself on a small VM). A bucket laid out like the arena (the learner
flattens `named_parameters()` in order) is staged with ONE copy; anything else tensor by tensor.
Memory: twice the model's parameters. Tied parameters (lm_head/embed_tokens) are one Parameter,
reachable by both names.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from shellrl.weights import bucket as wt
from shellrl.weights import disk as wtd
from shellrl.weights import gpu as wtg
from shellrl.weights import safe_unpickle as wsu
from shellrl.weights import shm

log = logging.getLogger(__name__)


class WeightUpdateError(ValueError):
    """A payload that cannot be applied; the message names the tensor or field."""


@dataclass
class StagedWeights:
    """New parameter tensors waiting for `commit`, by parameter name (views into an arena)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def merge(self, other: StagedWeights) -> None:
        self.tensors.update(other.tensors)


class WeightStore:
    """Names, shapes, dtype and device of the model's parameters; stages and commits updates.

    Staging is not thread-safe and must not overlap another uncommitted staging of the same
    parameter with a different payload (the runtime serializes updates).
    """

    def __init__(self, model, *, copy_on_commit: bool = False) -> None:
        self.model = model
        # copy_on_commit: `commit` copies the staged tensors into the parameters' own storages
        # (the decode graphs captured those addresses: services/engine/graph_decode.py) instead
        # of re-pointing the parameters; one device copy of the update per commit
        self.copy_on_commit = copy_on_commit
        self.params = dict(model.named_parameters(remove_duplicate=False))
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self._ipc_bucket: torch.Tensor | None = (
            None  # the last CUDA IPC bucket opened (see stage_serialized)
        )
        unique = list(model.named_parameters())
        by_param = {id(p): n for n, p in unique}
        self._canonical = {n: by_param[id(p)] for n, p in self.params.items()}
        layout, self._arena_bytes = wt.plan_bucket(
            [(n, p.detach()) for n, p in unique], wt.layout_align(p.dtype for _, p in unique)
        )
        self._layout = {m.name: m for m in layout}
        self._casts_noted: set[str] = set()  # bucket dtypes _note_cast has logged
        self._arenas: list[torch.Tensor | None] = [None, None]
        self._slots: list[dict[str, torch.Tensor]] = [
            {},
            {},
        ]  # views into each arena, made once per name
        # The last CUDA IPC payload string and what was learned from it: a learner that refills one
        # kept bucket (wtg.CudaIpcBucket) sends the same string every push (same handle, same layout),
        # so parsing, the 290-odd metadata checks and the handle's rebuild are done once, not per push.
        self._ipc_seen: (
            tuple[str, torch.Tensor, list[wt.TensorMeta], torch.cuda.Event | None] | None
        ) = None
        self._home = {
            n: -1 for n, _ in unique
        }  # arena each parameter lives in (-1: its load-time storage)
        # The last learner shared-memory segment, kept mapped: a learner refilling its kept segment sends
        # the same name every push, and mapping 513 MiB again (MAP_POPULATE) costs as much as the copy.
        self._shm_mapping: shm.SharedMemoryMapping | None = None
        self._envelope_buffer: torch.Tensor | None = (
            None  # the last SGLang-envelope bucket (see _stage_envelope)
        )

    def _check(self, named_tensors: list) -> None:
        """WeightUpdateError for an unknown name, a shape mismatch or a float-to-int replacement."""
        for name, tensor in named_tensors:
            self._check_one(name, tensor.shape, tensor.dtype)

    def _check_metadata(self, metadata: list[wt.TensorMeta], buffer_bytes: int) -> None:
        """`_check` from the metadata alone (no tensor views: on a GPU a view costs ~10 us of host
        time, ~6 ms for the 290 tensors of a 0.5B model), and every tensor inside the buffer."""
        for m in metadata:
            if not 0 <= m.start_idx <= m.end_idx <= buffer_bytes:
                raise WeightUpdateError(
                    f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) overrun the bucket "
                    f"({buffer_bytes} bytes)"
                )
            self._check_one(m.name, m.shape, m.dtype)

    def _check_one(self, name: str, shape, dtype: torch.dtype | str) -> None:
        """`_check` of one tensor; `dtype` may be torch's name of it (resolved after the shape)."""
        param = self.params.get(name)
        if param is None:
            raise WeightUpdateError(f"unknown parameter name {name!r}")
        if tuple(shape) != tuple(param.shape):
            raise WeightUpdateError(
                f"{name}: shape {list(shape)} does not match the model's {list(param.shape)}"
            )
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if not (dtype.is_floating_point or not param.dtype.is_floating_point):
            raise WeightUpdateError(f"{name}: dtype {dtype} cannot replace {param.dtype}")

    def _target(self, name: str) -> int:
        """The arena `name` is staged into: the one its parameter does not live in."""
        return 1 if self._home[self._canonical[name]] == 0 else 0

    def _arena(self, index: int) -> torch.Tensor:
        if self._arenas[index] is None:
            self._arenas[index] = torch.empty(
                self._arena_bytes, dtype=torch.uint8, device=self.device
            )
        return self._arenas[index]

    def _slot(self, name: str, index: int) -> torch.Tensor:
        canonical = self._canonical[name]
        view = self._slots[index].get(canonical)
        if view is None:
            view = wt.unflatten_tensors(self._arena(index), [self._layout[canonical]])[0][1]
            self._slots[index][canonical] = view
        return view

    def stage(self, named_tensors, source_dtype_ok: bool = True) -> StagedWeights:
        """Validate every (name, tensor), then copy each into its arena slot (converting dtype/device).

        Raises WeightUpdateError for an unknown name or a shape mismatch (before copying anything).
        """
        named_tensors = list(named_tensors)
        self._check(named_tensors)
        staged = StagedWeights()
        with torch.no_grad():
            for name, tensor in named_tensors:
                slot = self._slot(name, self._target(name))
                slot.copy_(tensor)
                staged.tensors[name] = slot
        return staged

    def stage_bucket(
        self, buffer: torch.Tensor, metadata: list[wt.TensorMeta], *, validated: bool = False
    ) -> StagedWeights:
        """Stage a flattened bucket (1-D uint8 `buffer` on any device, its metadata).

        When the bucket has the model's dtype and the arena's layout (same order and alignment, all
        parameters bound for the same arena), its used bytes are copied in ONE copy (one DMA on a
        GPU, not one per tensor). Otherwise each tensor is copied on its own (`stage`). Validation
        comes first (validated=True: this buffer and metadata passed it before, skip it); the
        sender's buffer may be reused as soon as this returns.
        """
        if not validated:
            self._check_metadata(metadata, buffer.numel())
        self._note_cast(metadata)
        if not self._arena_layout(metadata):
            views = wt.unflatten_tensors(buffer, metadata)
            self._check(views)
            return self.stage(views)
        index = self._target(metadata[0].name)
        first, last = self._layout[self._canonical[metadata[0].name]], metadata[-1]
        used = last.end_idx - metadata[0].start_idx
        with torch.no_grad():
            self._arena(index)[first.start_idx : first.start_idx + used].copy_(
                buffer[metadata[0].start_idx : metadata[0].start_idx + used]
            )
        return StagedWeights({m.name: self._slot(m.name, index) for m in metadata})

    def _note_cast(self, metadata: list[wt.TensorMeta]) -> None:
        """Log once per dtype a bucket arrives in that is not the model's: its tensors are cast by
        their copy into the model's dtype (tensor by tensor; a bfloat16 bucket into a float32
        model is exact, a float32 one into a bfloat16 model rounds)."""
        model_dtype = str(self.dtype).removeprefix("torch.")
        for dtype in {m.dtype for m in metadata} - {model_dtype} - self._casts_noted:
            self._casts_noted.add(dtype)
            log.warning(
                "weight bucket in another dtype than the model's: cast while copying",
                extra={"bucket_dtype": dtype, "model_dtype": model_dtype},
            )

    def _arena_layout(self, metadata: list[wt.TensorMeta]) -> bool:
        dtype_name = str(self.dtype).removeprefix("torch.")
        if not metadata or any(m.dtype != dtype_name for m in metadata):
            return False
        names = [self._canonical[m.name] for m in metadata]
        if len(set(names)) != len(names) or len({self._target(n) for n in names}) != 1:
            return False
        base, arena_base = metadata[0].start_idx, self._layout[names[0]].start_idx
        return all(
            m.start_idx - base == self._layout[n].start_idx - arena_base
            for m, n in zip(metadata, names)
        )

    def stage_serialized(
        self, serialized_named_tensors: list, load_format: str | None, tp_size: int = 1
    ) -> StagedWeights:
        """Stage the `serialized_named_tensors` of `/update_weights_from_tensor`: one entry per TP rank
        (`tp_size`), each SGLang's envelope (base64 of an allow-listed pickle, `shellrl.weights.safe_unpickle`)
        or shellrl's JSON bucket payload (`{"transport": "shm" | "cuda_ipc", ...}`, which SGLang
        refuses: not base64). Raises WeightUpdateError naming the field; nothing is applied then."""
        if load_format not in (wt.LOAD_FORMAT, None):
            raise WeightUpdateError(
                f"load_format: {load_format!r} is not supported; use {wt.LOAD_FORMAT!r} "
                "(or null for a list of (name, tensor))"
            )
        if (
            not isinstance(serialized_named_tensors, list)
            or len(serialized_named_tensors) != tp_size
        ):
            count = (
                len(serialized_named_tensors)
                if isinstance(serialized_named_tensors, list)
                else "not a list"
            )
            raise WeightUpdateError(
                f"serialized_named_tensors: expected {tp_size} entry (one per TP rank; "
                f"this engine has tp_size={tp_size}), got {count}"
            )
        entry = serialized_named_tensors[0]  # this engine is TP rank 0
        if not isinstance(entry, str):
            raise WeightUpdateError("serialized_named_tensors[0]: expected a base64 string")
        if not entry.lstrip().startswith("{"):
            return self._stage_envelope(entry, load_format)
        if load_format != wt.LOAD_FORMAT:
            raise WeightUpdateError(
                f"load_format: shellrl's JSON payloads are {wt.LOAD_FORMAT!r} buckets"
            )
        seen = self._ipc_seen
        if (
            seen is not None and seen[0] == entry
        ):  # the kept CUDA IPC bucket, refilled: validated before
            return self._stage_cuda(seen[1], seen[2], validated=True, ready=seen[3])
        try:
            payload = json.loads(entry)
        except json.JSONDecodeError as exc:
            raise WeightUpdateError(
                f"serialized_named_tensors[0] is not valid JSON: {exc}"
            ) from exc
        transport = payload.get("transport")
        try:
            if transport == "shm":
                metadata = [wt.TensorMeta.from_json(m) for m in payload.get("metadata") or []]
                return self.stage_bucket(
                    self._shm_buffer(str(payload.get("segment", ""))), metadata
                )
            if transport == "cuda_ipc":
                self._ipc_seen = None
                buffer, metadata = wtg.open_cuda_bucket(payload)
                ready = wtg.open_ready_event(payload, buffer.device)
                staged = self._stage_cuda(buffer, metadata, validated=False, ready=ready)
                # Kept open: a learner that refills the same bucket (wtg.CudaIpcBucket) sends the same
                # payload string, staged by the fast path above without parsing or opening anything.
                # Dropped (closed) when a different bucket arrives; one bucket at most is held.
                self._ipc_bucket = buffer
                self._ipc_seen = (entry, buffer, metadata, ready)
                return staged
        except (ValueError, FileNotFoundError) as exc:
            raise WeightUpdateError(str(exc)) from exc
        raise WeightUpdateError(f"unknown transport {transport!r} (expected 'shm' or 'cuda_ipc')")

    def _stage_envelope(self, entry: str, load_format: str | None) -> StagedWeights:
        """SGLang's envelope: unpickled under the allow-list, validated, staged. A flattened tensor
        that holds the whole model is kept (`_envelope_buffer`) until the next one: for a CPU
        bucket in torch's file-system shared memory, torch's receiver cache then returns the same
        mapping for the learner's kept bucket next push (no new mmap and page faults); a CUDA one
        stays open the same way. A bucket of part of the model is one of a streamed push, whose
        two slots alternate (services/learner/weights/bucket_stream.py): it is dropped after its copy, so
        this engine never keeps a learner's slot alive past its update call (for CUDA IPC that
        memory would stay allocated on the GPU until the engine let go)."""
        try:
            obj = wsu.deserialize(entry)
            if load_format is None:
                return self.stage(wsu.decode_named_tensors(obj))
            buffer, metadata = wsu.decode_flattened_bucket(obj)
        except ValueError as exc:  # EnvelopeError, or a tensor that does not fit its parameter
            raise WeightUpdateError(str(exc)) from exc
        self._envelope_buffer = None
        staged = (
            self._stage_cuda(buffer, metadata, validated=False)
            if buffer.is_cuda
            else self.stage_bucket(buffer, metadata)
        )
        if len({self._canonical.get(m.name) for m in metadata}) == len(self._layout):
            self._envelope_buffer = buffer
        return staged

    def _shm_buffer(self, segment: str) -> torch.Tensor:
        """The segment's bytes through the kept mapping when it is the same segment (name, inode,
        size), else a new mapping (the old one is dropped). FileNotFoundError / ValueError as mapping."""
        kept = self._shm_mapping
        if kept is not None and kept.key == shm.SharedMemoryMapping.current_key(segment):
            return kept.buffer
        self._shm_mapping = None
        if kept is not None:
            kept.close()
        self._shm_mapping = shm.SharedMemoryMapping(segment)
        return self._shm_mapping.buffer

    def _stage_cuda(
        self,
        buffer: torch.Tensor,
        metadata: list[wt.TensorMeta],
        validated: bool,
        ready: torch.cuda.Event | None = None,
    ) -> StagedWeights:
        """ready: the producer's event recorded after it wrote the bucket (its copies may still run);
        this thread's stream waits on it before the arena copies read the bucket."""
        if ready is not None:  # the arena copies read the bucket on its device's current stream
            torch.cuda.current_stream(buffer.device).wait_event(ready)
        staged = self.stage_bucket(buffer, metadata, validated=validated)
        for device in {self.device, buffer.device}:  # copies done before the producer may reuse it
            torch.cuda.synchronize(device)
        return staged

    def stage_disk(self, model_path: str) -> StagedWeights:
        """Stage every tensor of the safetensors files in `model_path`."""
        try:
            named = wtd.load_safetensors_dir(model_path)
        except (FileNotFoundError, OSError) as exc:
            raise WeightUpdateError(str(exc)) from exc
        buffers = {name for name, _ in self.model.named_buffers()}
        return self.stage((n, t) for n, t in named if n not in buffers)

    def commit(self, staged: StagedWeights) -> int:
        """Point the parameters at their staged arena slots (scheduler thread, between steps; no copy),
        or with `copy_on_commit` copy the slots into the parameters' storages (which then never
        move, so the next update stages into the same arena). Returns the number of tensors."""
        if self.copy_on_commit:
            names = list(staged.tensors)
            with torch.no_grad():  # one fused launch, not one copy per tensor
                torch._foreach_copy_(
                    [self.params[n].data for n in names], [staged.tensors[n] for n in names]
                )
            return len(staged.tensors)
        homes = {
            self._canonical[name]: self._target(name) for name in staged.tensors
        }  # before any flips
        with torch.no_grad():
            for name, tensor in staged.tensors.items():
                self.params[name].data = tensor
        self._home.update(homes)
        return len(staged.tensors)
