"""One learner step: decoupled PPO over a TrainBatch, with ppo_epochs inner AdamW updates.

Consumes a TrainBatch (shellrl.rl.batch) whose advantages are already set; produces updated
weights and a StepResult (loss terms, clip fractions, importance weights, parity). Guarantees:
* The loss and gradients do not depend on micro_batch_size: per-token weights come from the whole
  batch (`loss_weights`) and micro-batch gradients are summed.
* Proximal log-probs are the learner's log-probs at the start of the step. They are taken from the
  first epoch's forward pass (same weights, same computation, so bit-identical to a separate
  no-grad pass), which saves that pass; later epochs use them for the ratio. With ppo_epochs = 1
  the ratio is exactly 1, the clip never binds, and the loss is REINFORCE with a group baseline,
  weighted by the truncated behavior importance weight.
* A step whose gradient norm is not finite updates nothing (counted in `skipped_updates`).
* Parity: mean and max of |logp_prox - logp_behavior| over tokens sampled by the current weights
  (policy_version == the version being trained), DESIGN.md section 5.
The learning rate follows linear warmup over `warmup_steps`, then constant: the LR used by step k
(1-based) is lr * min(1, k / warmup_steps), restored exactly on resume (known_pitfalls C35).
"""

from __future__ import annotations

import copy
import ctypes
import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from shellrl.rl.batch import TrainBatch
from shellrl.rl.logprobs import enable_gradient_checkpointing, token_logprobs
from shellrl.rl.losses import LossStats, PPOConfig, decoupled_ppo_loss, loss_weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    """lr: peak AdamW learning rate; warmup_steps: linear warmup (0 = none); grad_clip_norm: max
    global L2 norm (<= 0: off); ppo_epochs: AdamW updates per batch; micro_batch_size: sequences
    per forward/backward; chunk_tokens: LM-head positions per float32 chunk; share_prefix_min_tokens:
    a prefix common to a micro-batch's rows of at least this many tokens runs once (0: off; skipped
    under gradient checkpointing, see shellrl.rl.logprobs); loss: PPOConfig."""

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


@dataclass(frozen=True)
class StepResult:
    """What one step did. `stats`: LossStats.summary() of the last epoch plus grad norms; parity_*
    in nats over `parity_tokens` version-fresh tokens; durations in seconds."""

    step: int
    lr: float
    stats: dict[str, float]
    grad_norm: float
    parity_mean: float
    parity_max: float
    parity_tokens: int
    sequences: int
    tokens: int
    duration_s: float
    skipped_updates: int


class Trainer:
    """Owns the model's optimizer and schedule; `step()` trains on one batch (blocking, CPU/GPU)."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig) -> None:
        self.model, self.config = model, config
        _disable_dropout(model)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.reference = None
        if config.loss.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.step_count = 0

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, batch: TrainBatch, learner_version: int) -> StepResult:
        """Train on `batch` (advantages set) with the weights of `learner_version`; one step."""
        start, cfg = time.perf_counter(), self.config
        batch = batch.to(
            self.params[0].device
        )  # built on CPU by the worker; the model may be on a GPU
        lr = self.lr
        weights = loss_weights(batch.loss_mask, cfg.loss.aggregation)
        proximal = torch.zeros_like(batch.loss_mask)
        grad_norm, skipped = 0.0, 0
        for epoch in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            stats = LossStats()
            for lo in range(0, batch.size, cfg.micro_batch_size):
                hi = min(lo + cfg.micro_batch_size, batch.size)
                stats = stats + self._accumulate(
                    batch.rows(lo, hi), lo, hi, weights, proximal, first=epoch == 0
                )
            grad_norm = self._clip()
            if torch.isfinite(torch.tensor(grad_norm)):
                self.optimizer.step()
            else:
                skipped += 1
                log.error(
                    "non-finite gradient norm: update skipped",
                    extra={"epoch": epoch, "grad_norm": grad_norm},
                )
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step_count += 1
        parity = _parity(proximal, batch, learner_version)
        result = StepResult(
            step=self.step_count,
            lr=lr,
            stats={**stats.summary(), "grad_norm": grad_norm},
            grad_norm=grad_norm,
            parity_mean=parity[0],
            parity_max=parity[1],
            parity_tokens=parity[2],
            sequences=batch.size,
            tokens=batch.num_loss_tokens,
            duration_s=time.perf_counter() - start,
            skipped_updates=skipped,
        )
        del proximal, weights
        release_memory()
        return result

    def skip_step(self) -> None:
        """A step without trainable data (e.g. every group had zero reward variance): no update, but
        the step counter and the LR schedule advance like any step."""
        self.scheduler.step()
        self.step_count += 1

    def _accumulate(
        self,
        mb: TrainBatch,
        lo: int,
        hi: int,
        weights: torch.Tensor,
        proximal: torch.Tensor,
        first: bool,
    ) -> LossStats:
        if mb.num_loss_tokens == 0:
            return LossStats()
        width = mb.loss_mask.shape[1]
        logp = self._logprobs(self.model, mb)
        if first:
            proximal[lo:hi, :width] = logp.detach()
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logprobs(self.reference, mb)
        loss, stats = decoupled_ppo_loss(
            logp,
            proximal[lo:hi, :width],
            mb.behavior_logprobs,
            mb.advantages,
            mb.loss_mask,
            weights[lo:hi, :width],
            self.config.loss,
            ref,
        )
        loss.backward()
        return stats

    def _clip(self) -> float:
        if self.config.grad_clip_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip_norm))
        grads = [p.grad.norm() for p in self.params if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L-1] float32 log-probs of the batch's scored tokens under the current weights."""
        batch = batch.to(self.params[0].device)
        out = torch.zeros_like(batch.loss_mask)
        for lo in range(0, batch.size, self.config.micro_batch_size):
            hi = min(lo + self.config.micro_batch_size, batch.size)
            mb = batch.rows(lo, hi)
            out[lo:hi, : mb.loss_mask.shape[1]] = self._logprobs(self.model, mb)
        return out

    def _logprobs(self, model, mb: TrainBatch) -> torch.Tensor:
        return token_logprobs(
            model,
            mb,
            chunk_tokens=self.config.chunk_tokens,
            share_prefix_min_tokens=self.config.share_prefix_min_tokens,
        )

    def state_dict(self) -> dict:
        """Optimizer, scheduler and step counter (the model's weights are saved separately)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step_count,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step"])


def _parity(
    proximal: torch.Tensor, batch: TrainBatch, learner_version: int
) -> tuple[float, float, int]:
    fresh = (batch.loss_mask > 0) & (batch.policy_versions == learner_version)
    n = int(fresh.sum())
    if n == 0:
        return 0.0, 0.0, 0
    diff = (proximal - batch.behavior_logprobs)[fresh].abs()
    return float(diff.mean()), float(diff.max()), n


def _disable_dropout(model: torch.nn.Module) -> None:
    """RL fine-tuning runs without dropout: the proximal pass and the training pass must agree."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


_LIBC = None


def release_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc malloc_trim), so RSS tracks
    live memory over a long run of steps with varying shapes (feasibility.md: 1.7 -> 10 GB)."""
    global _LIBC
    gc.collect()
    try:
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass
