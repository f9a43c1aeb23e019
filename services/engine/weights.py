"""Weight updates of the engine's model: read, validate and stage new tensors; swap them in later.

Consumes the payloads of `/update_weights_from_tensor` (`shellrl.weight_transport` JSON: a shared
memory bucket, or a CUDA IPC bucket on this engine's GPU) and `/update_weights_from_disk`
(safetensors directory). Produces a `StagedWeights`: new tensors already in the model's dtype and
device, each checked against the parameter it replaces (known name, identical shape). Nothing is
touched until the scheduler calls `commit` between two decoding steps, so a bad payload leaves
the engine serving its old weights and no token is computed with half-old, half-new weights.

Commit swaps `param.data` (no copy). Tied parameters (lm_head/embed_tokens) are one Parameter,
reachable by both names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from shellrl import weight_transport as wt


class WeightUpdateError(ValueError):
    """A payload that cannot be applied; the message names the tensor or field."""


@dataclass
class StagedWeights:
    """New parameter tensors waiting for `commit`, by parameter name."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def merge(self, other: "StagedWeights") -> None:
        self.tensors.update(other.tensors)


class WeightStore:
    """Names, shapes, dtype and device of the model's parameters; stages and commits updates."""

    def __init__(self, model) -> None:
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self._ipc_bucket: torch.Tensor | None = None  # the last CUDA IPC bucket opened (see stage_serialized)

    def _check(self, named_tensors: list) -> None:
        """WeightUpdateError for an unknown name, a shape mismatch or a float-to-int replacement."""
        for name, tensor in named_tensors:
            param = self.params.get(name)
            if param is None:
                raise WeightUpdateError(f"unknown parameter name {name!r}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightUpdateError(f"{name}: shape {list(tensor.shape)} does not match the model's "
                                        f"{list(param.shape)}")
            if not (tensor.dtype.is_floating_point or not param.dtype.is_floating_point):
                raise WeightUpdateError(f"{name}: dtype {tensor.dtype} cannot replace {param.dtype}")

    def stage(self, named_tensors, source_dtype_ok: bool = True) -> StagedWeights:
        """Validate every (name, tensor) and return copies in the model's dtype/device.

        Raises WeightUpdateError for an unknown name or a shape mismatch (before copying anything).
        """
        named_tensors = list(named_tensors)
        self._check(named_tensors)
        staged = StagedWeights()
        for name, tensor in named_tensors:
            staged.tensors[name] = tensor.to(device=self.device, dtype=self.dtype, copy=True).contiguous()
        return staged

    def stage_bucket(self, buffer: torch.Tensor, metadata: list[wt.TensorMeta]) -> StagedWeights:
        """Stage a flattened bucket (1-D uint8 `buffer` on any device, its metadata).

        When every entry already has the model's dtype, the used bytes are copied to the model's
        device in ONE copy (one DMA, not one per tensor: on a GPU, ~290 small copies of a 0.5B
        model cost milliseconds of launches alone) and the staged tensors are views into that
        copy. Otherwise each tensor is converted on its own (`stage`). Validation comes first.
        """
        views = wt.unflatten_tensors(buffer, metadata)
        self._check(views)
        dtype_name = str(self.dtype).removeprefix("torch.")
        if not metadata or any(m.dtype != dtype_name for m in metadata):
            return self.stage(views)
        used = max(m.end_idx for m in metadata)
        local = buffer[:used].to(self.device, copy=True)
        return StagedWeights(dict(wt.unflatten_tensors(local, metadata)))

    def stage_serialized(self, serialized_named_tensors: list[str], load_format: str | None) -> StagedWeights:
        """Stage the `serialized_named_tensors` of `/update_weights_from_tensor` (JSON payloads only)."""
        if load_format != wt.LOAD_FORMAT:
            raise WeightUpdateError(f"load_format {load_format!r} is not supported; use {wt.LOAD_FORMAT!r}")
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise WeightUpdateError("serialized_named_tensors must be a non-empty list")
        # One entry per TP rank; this engine is a single rank, so it reads entry 0 (as TP rank 0 does).
        entry = serialized_named_tensors[0]
        if not isinstance(entry, str) or not entry.lstrip().startswith("{"):
            raise WeightUpdateError("serialized_named_tensors[0] must be a shellrl JSON bucket payload; pickled "
                                    "payloads are never unpickled by this engine")
        try:
            payload = json.loads(entry)
        except json.JSONDecodeError as exc:
            raise WeightUpdateError(f"serialized_named_tensors[0] is not valid JSON: {exc}") from exc
        transport = payload.get("transport")
        try:
            if transport == "shm":
                with wt.open_shared_memory_buffer(payload) as (buffer, metadata):
                    return self.stage_bucket(buffer, metadata)
            if transport == "cuda_ipc":
                buffer, metadata = wt.open_cuda_bucket(payload)
                staged = self.stage_bucket(buffer, metadata)
                for device in {self.device, buffer.device}:  # copies done before the producer may reuse it
                    torch.cuda.synchronize(device)
                # Kept open: a learner that refills the same bucket (wt.CudaIpcBucket) sends the same
                # handle, which torch's IPC cache then maps without cudaIpcOpenMemHandle. Dropped
                # (closed) when a different bucket arrives; one bucket at most is held.
                self._ipc_bucket = buffer
                return staged
        except (ValueError, FileNotFoundError) as exc:
            raise WeightUpdateError(str(exc)) from exc
        raise WeightUpdateError(f"unknown transport {transport!r} (expected 'shm' or 'cuda_ipc')")

    def stage_disk(self, model_path: str) -> StagedWeights:
        """Stage every tensor of the safetensors files in `model_path`."""
        try:
            named = wt.load_safetensors_dir(model_path)
        except (FileNotFoundError, OSError) as exc:
            raise WeightUpdateError(str(exc)) from exc
        buffers = {name for name, _ in self.model.named_buffers()}
        return self.stage((n, t) for n, t in named if n not in buffers)

    def commit(self, staged: StagedWeights) -> int:
        """Swap staged tensors in (scheduler thread, between steps). Returns the number of tensors."""
        with torch.no_grad():
            for name, tensor in staged.tensors.items():
                self.params[name].data = tensor
        return len(staged.tensors)
