"""The learner's Trainer configuration (`TrainerConfig`: optimizer, schedule, micro-batching,
log-prob computation, the KL reference's dtype, the loss), checked when built (ValueError).
parts.py builds it from LearnerSettings; trainer.py reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shellrl.rl.losses import PPOConfig

REFERENCE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainerConfig:
    """lr: peak AdamW learning rate; warmup_steps: linear warmup (0 = none); grad_clip_norm: max
    global L2 norm (<= 0: off); ppo_epochs: AdamW updates per batch; micro_batch_size: sequences
    per forward/backward; chunk_tokens: LM-head positions per float32 chunk; share_prefix_min_tokens:
    a prefix common to a micro-batch's rows of at least this many tokens runs once (0: off; skipped
    under gradient checkpointing, see shellrl.rl.logprobs); unpadded_rows: on CPU, after a shared
    prefix, each row's own tokens run without padding (shellrl.rl.logprobs.decoder_hidden; the
    same log-probs to float rounding); fused_optimizer: AdamW's fused kernel
    (torch.optim.AdamW(fused=True), CPU and CUDA; not with FSDP) instead of its per-tensor loop,
    the same update up to float rounding; reference_dtype: the KL reference's decoder under
    autocast to "bfloat16" (the LM head stays float32) or "float32" (issue 33 item 3: measured in
    BENCHMARKS.md); loss: PPOConfig."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip_norm: float = 1.0
    ppo_epochs: int = 1
    micro_batch_size: int = 4
    chunk_tokens: int = 1024
    gradient_checkpointing: bool = True
    share_prefix_min_tokens: int = 32
    unpadded_rows: bool = True
    fused_optimizer: bool = True
    reference_dtype: str = "float32"
    loss: PPOConfig = field(default_factory=PPOConfig)

    def __post_init__(self) -> None:
        if (
            self.lr <= 0
            or self.ppo_epochs < 1
            or self.micro_batch_size < 1
            or self.warmup_steps < 0
        ):
            raise ValueError(
                "lr > 0, ppo_epochs >= 1, micro_batch_size >= 1 and warmup_steps >= 0 are required"
            )
        if self.reference_dtype not in REFERENCE_DTYPES:
            raise ValueError(
                f"reference_dtype must be one of {sorted(REFERENCE_DTYPES)}; got {self.reference_dtype!r}"
            )
