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

Data parallel (ranks.py, data_parallel.py): with FSDP2 the model is sharded (sharding.py) and
each rank trains its share of the step under a `StepPlan` every rank agrees on: the loss is
divided by the whole step's token count (so the summed gradients, hence the update, do not
depend on the world size) and every rank runs the same number of forward/backward passes (a
rank with fewer rows runs idle passes that change no gradient: each pass all-gathers and
reduce-scatters with the other ranks). Without FSDP a step is exactly what it was.
"""

from __future__ import annotations

import copy
import logging
import time

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from services.learner import ranks as learner_ranks
from services.learner.allocator import release_memory
from services.learner.sharding import PolicyLogprobs, shard
from services.learner.step_records import StepPlan, StepResult, idle_batch
from services.learner.trainer_config import REFERENCE_DTYPES, TrainerConfig
from shellrl.rl.batch import TrainBatch
from shellrl.rl.logprobs import enable_gradient_checkpointing
from shellrl.rl.losses import LossStats, decoupled_ppo_loss, loss_weights, row_kl

log = logging.getLogger(__name__)


class Trainer:
    """Owns the model's optimizer and schedule; `step()` trains on one batch (blocking, CPU/GPU).
    ranks: this process's rank (default ranks.current()); with `ranks.fsdp` the model is sharded
    in place (sharding.shard) and every collective call here must be made on every rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig,
        ranks: learner_ranks.Ranks | None = None,
    ) -> None:
        self.model, self.config = model, config
        self.ranks = ranks or learner_ranks.current()
        _disable_dropout(model)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model.train()
        self.reference = None
        if config.loss.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        # a GPU runs a padded batch in fewer launches than its rows one by one (not measured)
        unpadded = config.unpadded_rows and next(model.parameters()).device.type == "cpu"
        self.policy = PolicyLogprobs(
            model, config.chunk_tokens, config.share_prefix_min_tokens, unpadded
        )
        self.reference_policy = None
        if self.reference is not None:
            self.reference_policy = PolicyLogprobs(
                self.reference,
                config.chunk_tokens,
                config.share_prefix_min_tokens,
                unpadded,
            )
        if self.sharded:
            device_type = next(model.parameters()).device.type
            shard(self.policy, self.ranks.world_size, device_type)
            if self.reference_policy is not None:
                shard(self.reference_policy, self.ranks.world_size, device_type)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
            **({"fused": True} if config.fused_optimizer and not self.sharded else {}),
        )
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.step_count = 0

    @property
    def sharded(self) -> bool:
        """The model is sharded with FSDP2 (its parameters are DTensors)."""
        return self.ranks.fsdp

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def step(
        self, batch: TrainBatch | None, learner_version: int, plan: StepPlan | None = None
    ) -> StepResult:
        """Train on `batch` (advantages set) with the weights of `learner_version`; one step.
        plan: the step's plan when `batch` is this rank's share of it (None: the batch is the
        whole step); batch None: this rank has no rows this step (it runs idle passes)."""
        start, cfg = time.perf_counter(), self.config
        mbs = cfg.micro_batch_size
        if plan is None:
            plan = StepPlan(
                micro_batches=-(-batch.size // mbs),
                loss_tokens=batch.num_loss_tokens,
                loss_rows=int((batch.loss_mask.sum(-1) > 0).sum()),
            )
        if batch is not None:  # built on CPU by the worker; the model may be on a GPU
            batch = batch.to(self.params[0].device)
        lr = self.lr
        weights = proximal = None
        if batch is not None:
            weights = loss_weights(
                batch.loss_mask,
                cfg.loss.aggregation,
                loss_tokens=plan.loss_tokens,
                loss_rows=plan.loss_rows,
            )
            proximal = torch.zeros_like(batch.loss_mask)
        grad_norm, skipped, kls = 0.0, 0, []
        for epoch in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            stats = LossStats()
            for k in range(plan.micro_batches):
                lo = k * mbs
                if batch is None or lo >= batch.size:
                    self._idle_pass()
                    continue
                hi = min(lo + mbs, batch.size)
                stats = stats + self._accumulate(
                    batch.rows(lo, hi), lo, hi, weights, proximal, kls if epoch == 0 else None
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
        parity = (0.0, 0.0, 0) if batch is None else _parity(proximal, batch, learner_version)
        result = StepResult(
            step=self.step_count,
            lr=lr,
            stats={**stats.summary(), "grad_norm": grad_norm},
            grad_norm=grad_norm,
            parity_mean=parity[0],
            parity_max=parity[1],
            parity_tokens=parity[2],
            sequences=0 if batch is None else batch.size,
            tokens=0 if batch is None else batch.num_loss_tokens,
            duration_s=time.perf_counter() - start,
            skipped_updates=skipped,
            totals=stats,
            row_kl=tuple(kls),
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
        kls: list | None,
    ) -> LossStats:
        """One micro-batch's forward and backward. kls: None after the first epoch; in the first,
        this micro-batch's rows' KL to the reference are appended to it (StepResult.row_kl)."""
        if mb.num_loss_tokens == 0:
            if self.sharded:
                self._idle_pass()
            return LossStats()
        width = mb.loss_mask.shape[1]
        logp = self.policy(mb)
        if kls is not None:
            proximal[lo:hi, :width] = logp.detach()
        ref = None
        if self.reference_policy is not None:
            with torch.no_grad(), self._reference_autocast():
                ref = self.reference_policy(mb)
            if kls is not None:
                sums, counts = row_kl(logp, ref, mb.loss_mask, self.config.loss.max_log_ratio)
                kls += zip(mb.trajectory_ids, sums.tolist(), map(int, counts.tolist()))
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

    def _reference_autocast(self):
        """The reference forward's autocast context (`reference_dtype`; off for float32)."""
        dtype = REFERENCE_DTYPES[self.config.reference_dtype]
        device_type = self.params[0].device.type
        return torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)

    def _idle_pass(self) -> None:
        """A forward and backward that adds nothing to any gradient (loss * 0 over one token), so
        that this rank joins the other ranks' all-gathers and reduce-scatters of a pass."""
        batch = idle_batch().to(self.params[0].device)
        positions = torch.ones_like(batch.loss_mask, dtype=torch.bool)
        if self.reference_policy is not None:
            with torch.no_grad():
                self.reference_policy(batch, positions)
        (self.policy(batch, positions).sum() * 0.0).backward()

    def _clip(self) -> float:
        """The global gradient L2 norm (over every rank's shards), clipped to grad_clip_norm."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.config.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.config.grad_clip_norm, total)
        return float(total)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L-1] float32 log-probs of the batch's scored tokens under the current weights
        (sharded: a collective; every rank calls it with the same number of micro-batches)."""
        batch = batch.to(self.params[0].device)
        out = torch.zeros_like(batch.loss_mask)
        for lo in range(0, batch.size, self.config.micro_batch_size):
            hi = min(lo + self.config.micro_batch_size, batch.size)
            mb = batch.rows(lo, hi)
            out[lo:hi, : mb.loss_mask.shape[1]] = self.policy(mb)
        return out

    def checkpoint_state(self) -> dict:
        """The training state as torch.distributed.checkpoint saves and loads it: "model" and
        "optimizer" (this rank's shards, keyed by parameter name), "schedule" (LR scheduler and
        step counter). Sharded: a collective."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        schedule = {"scheduler": self.scheduler.state_dict(), "step": self.step_count}
        return {"model": model, "optimizer": optimizer, "schedule": schedule}

    def load_checkpoint_state(self, saved: dict) -> None:
        """Restore what `checkpoint_state` returned, filled by a load. Sharded: a collective."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=saved["model"],
            optim_state_dict=saved["optimizer"],
        )
        self.scheduler.load_state_dict(saved["schedule"]["scheduler"])
        self.step_count = int(saved["schedule"]["step"])

    def full_state_dict(self) -> dict | None:
        """Sharded: the whole weights by parameter name on CPU on the leader, {} on the others (a
        collective). Not sharded: None (the model's own state_dict is whole)."""
        if not self.sharded:
            return None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)


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
