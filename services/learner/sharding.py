"""FSDP2 (`torch.distributed.fsdp.fully_shard`) of the policy, and its full weights for a push.

`PolicyLogprobs` is the module the trainer calls: its forward is shellrl.rl.logprobs.token_logprobs
(decoder, then the LM head per sequence). `shard` wraps each decoder layer and then this module,
so the root unit owns the embedding (tied to the LM head), the final norm and the LM head, which
stay unsharded for the whole forward and backward although the LM head runs outside the HF
model's own forward. Gradients are SUMMED across ranks (divide factor 1, sum reductions only, as
gloo has no premultiplied sum): each rank's loss is already divided by the whole step's token
count (shellrl.rl.losses.loss_weights), so the sum is the gradient of the step's loss whatever
the world size.

`FullWeights` is the model as a weight push reads it: `named_parameters()` yields (HF name, full
tensor) one parameter at a time (`DTensor.full_tensor()`, an all-gather every rank joins; the
leader's `announce` tells the followers to gather with it), so the leader holds its shard and
the parameter being gathered, besides what the consumer keeps. The weight push
(weight_transport.WeightStaging) plans its buckets from `layout()` and copies each gathered
parameter into its slot before the next is gathered: the full model is never on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from shellrl.rl.batch import TrainBatch
from shellrl.rl.logprobs import token_logprobs
from shellrl.weights.bucket import describe


class PolicyLogprobs(torch.nn.Module):
    """model: a HF causal LM. forward(batch, positions=None) -> [b, L-1] float32 log-probs of the
    scored positions (see token_logprobs; differentiable when grad is enabled)."""

    def __init__(
        self,
        model: torch.nn.Module,
        chunk_tokens: int,
        share_prefix_min_tokens: int,
        unpadded_rows: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens, self.share_prefix_min_tokens = chunk_tokens, share_prefix_min_tokens
        self.unpadded_rows = unpadded_rows

    def forward(self, batch: TrainBatch, positions: torch.Tensor | None = None) -> torch.Tensor:
        return token_logprobs(
            self.model,
            batch,
            positions=positions,
            chunk_tokens=self.chunk_tokens,
            share_prefix_min_tokens=self.share_prefix_min_tokens,
            unpadded_rows=self.unpadded_rows,
        )


def shard(policy: PolicyLogprobs, world_size: int, device_type: str) -> None:
    """FSDP2 over all `world_size` ranks: every decoder layer, then `policy` (the root), in place.
    Prefix sharing is turned off: it runs the decoder twice on some micro-batches only, and every
    rank must run the same passes. Needs the process group (ranks.init_ranks)."""
    mesh = init_device_mesh(device_type, (world_size,))
    for layer in policy.model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.9
                module.set_force_sum_reduction_for_comms(True)
    policy.share_prefix_min_tokens = 0


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's all-gather (a collective: every rank calls it), else itself."""
    with torch.no_grad():
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def gather_all(model: torch.nn.Module) -> None:
    """A follower's side of `FullWeights.named_parameters`: the same all-gathers, results dropped."""
    for _, parameter in model.named_parameters():
        full_tensor(parameter)


class FullWeights:
    """What WeightSync.push reads instead of the model when it is sharded. model: the HF model
    (parameters are DTensors); announce: called once before each gather (the leader's command
    to the followers)."""

    def __init__(self, model: torch.nn.Module, announce: Callable[[], None]) -> None:
        self.model, self.announce = model, announce

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The local shards (for their device and dtype; nothing is gathered)."""
        return self.model.parameters()

    def layout(self) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor of the full parameter's dtype and shape) per parameter, in the order
        `named_parameters` gathers them; nothing is gathered (a DTensor knows its global shape).
        What a streamed push plans its buckets from before the first gather."""
        return describe(self.model.named_parameters())

    @property
    def device(self) -> torch.device:
        """Where the gathered tensors are: the local shards' device."""
        return next(self.model.parameters()).device

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per parameter, in the model's order, gathered as it is consumed.
        Closing the iterator early still gathers the rest (the followers are gathering them)."""
        self.announce()
        params = list(self.model.named_parameters())
        done, failed = 0, False
        try:
            for name, parameter in params:
                try:
                    full = full_tensor(parameter)
                except BaseException:
                    failed = True  # the group is broken: gathering more would fail too
                    raise
                done += 1
                yield name, full
                del full  # not alive while the next one is gathered
        finally:
            if not failed:
                for _, parameter in params[done:]:
                    full_tensor(parameter)
