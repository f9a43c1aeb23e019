"""Batch builder: trajectories -> right-padded tensors aligned by the shift-by-one rule.

DESIGN.md section 4, rule 3: with prompt length P and response length R, the log-prob of response
token t is read from the logits at position P-1+t, so every per-token array of the response
(loss mask, behavior log-probs, advantages, temperatures, policy versions) is written into
`[P-1 : P+R-1]` of a `[B, L-1]` tensor whose column j scores `input_ids[:, j+1]` (`target_ids`).
Padding is on the right with `pad_token_id`, has attention mask 0 and loss mask 0; position ids
are `cumsum(attention_mask) - 1` (0..P+R-1 for the real tokens, whatever the padding).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch


@dataclass(frozen=True)
class TrainSample:
    """One trajectory ready for training.

    prompt_ids: [P] int; response_ids: [R] int; behavior_logprobs: [R] float32 (engine log-probs,
    0 where loss_mask is 0); loss_mask: [R] 0/1; policy_versions: [R] int64 (-1 off ACTION tokens);
    temperatures: [R] float32 sampling temperature of each token (> 0); advantage: the GRPO
    advantage of the trajectory, broadcast to its loss-mask tokens.
    """

    trajectory_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behavior_logprobs: np.ndarray
    loss_mask: np.ndarray
    policy_versions: np.ndarray
    temperatures: np.ndarray
    advantage: float

    def __post_init__(self) -> None:
        r = len(self.response_ids)
        for name in ("behavior_logprobs", "loss_mask", "policy_versions", "temperatures"):
            if len(getattr(self, name)) != r:
                raise ValueError(
                    f"{self.trajectory_id}: {name} has {len(getattr(self, name))} entries, "
                    f"response_ids has {r}"
                )
        if len(self.prompt_ids) == 0:
            raise ValueError(
                f"{self.trajectory_id}: empty prompt (the first response token needs a prompt token "
                "before it to be scored)"
            )


@dataclass(frozen=True)
class TrainBatch:
    """Tensors of B trajectories, right-padded to length L.

    input_ids, attention_mask, position_ids: [B, L] int64.
    target_ids: [B, L-1] int64 = input_ids[:, 1:] (column j scores token j+1).
    loss_mask, behavior_logprobs, advantages, temperatures: [B, L-1] float32 (temperatures 1.0
    where nothing is scored); policy_versions: [B, L-1] int64 (-1 where nothing is scored).
    lengths: [B] int64 = P+R of each row. trajectory_ids: B strings in row order.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor
    policy_versions: torch.Tensor
    lengths: torch.Tensor
    trajectory_ids: tuple[str, ...]
    pad_to_multiple_of: int = 1

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device) -> TrainBatch:
        """The same batch with every tensor on `device` (self when already there)."""
        if self.input_ids.device == torch.device(device):
            return self
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), cut to their own longest row rounded up to `pad_to_multiple_of`."""
        length = int(self.lengths[start:stop].max().item())
        length = min(
            -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of,
            int(self.input_ids.shape[1]),
        )
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "pad_to_multiple_of":
                continue
            if f.name in ("trajectory_ids", "lengths"):
                out[f.name] = value[start:stop]
            elif value.dim() == 2:
                width = length if value.shape[1] == self.input_ids.shape[1] else length - 1
                out[f.name] = value[start:stop, :width]
            else:
                out[f.name] = value[start:stop]
        return replace(self, **out)

    def micro_batches(self, micro_batch_size: int) -> Iterator[TrainBatch]:
        """Consecutive slices of at most `micro_batch_size` rows. Raises ValueError if size < 1."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
        for start in range(0, self.size, micro_batch_size):
            yield self.rows(start, min(start + micro_batch_size, self.size))


def build_batch(
    samples: Sequence[TrainSample], pad_token_id: int, pad_to_multiple_of: int = 1
) -> TrainBatch:
    """Right-pad `samples` into a TrainBatch (see the module docstring for the alignment).

    L = max(P+R) rounded up to a multiple of `pad_to_multiple_of` (fewer distinct shapes keep the
    allocator from fragmenting over a long run). Raises ValueError on an empty list.
    Example: P=3, R=4 puts the response's mask and behavior log-probs at columns 2..5 of [B, L-1].
    """
    if not samples:
        raise ValueError("build_batch needs at least one sample")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    length = max(lengths)
    length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    input_ids = np.full((b, length), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((b, length), dtype=np.int64)
    loss_mask = np.zeros((b, length - 1), dtype=np.float32)
    behavior = np.zeros((b, length - 1), dtype=np.float32)
    advantages = np.zeros((b, length - 1), dtype=np.float32)
    temperatures = np.ones((b, length - 1), dtype=np.float32)
    versions = np.full((b, length - 1), -1, dtype=np.int64)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p] = s.prompt_ids
        input_ids[i, p : p + r] = s.response_ids
        attention_mask[i, : p + r] = 1
        cols = slice(p - 1, p + r - 1)  # shift by one: logits at P-1+t score response token t
        mask = np.asarray(s.loss_mask, dtype=np.float32)
        loss_mask[i, cols] = mask
        behavior[i, cols] = np.where(mask > 0, s.behavior_logprobs, 0.0)
        advantages[i, cols] = mask * np.float32(s.advantage)
        temperatures[i, cols] = np.where(mask > 0, s.temperatures, 1.0)
        versions[i, cols] = np.where(mask > 0, s.policy_versions, -1)
    attention = torch.from_numpy(attention_mask)
    ids = torch.from_numpy(input_ids)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        target_ids=ids[:, 1:].clone(),
        loss_mask=torch.from_numpy(loss_mask),
        behavior_logprobs=torch.from_numpy(behavior),
        advantages=torch.from_numpy(advantages),
        temperatures=torch.from_numpy(temperatures),
        policy_versions=torch.from_numpy(versions),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        trajectory_ids=tuple(s.trajectory_id for s in samples),
        pad_to_multiple_of=pad_to_multiple_of,
    )
