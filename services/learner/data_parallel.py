"""Data parallelism of the learner: rank 0 hands every rank its share of a step, each rank trains
its share, FSDP2 sums the gradients, and rank 0 merges the step's statistics.

    rank 0 (worker.py: DataParallel)                          ranks 1..N-1 (`follow`)
    step(samples) ─ split_by_tokens, StepPlan ─ scatter STEP(share) ─▶ build_batch, Trainer.step
                  ◀──────────────────────── gather StepResult ────────
    skip_step ─ scatter SKIP ─────────────────────────────────────────▶ Trainer.skip_step
    save(state) ─ begin ─ scatter SAVE(dir) ─ write_rank ─────────────▶ write_rank
                  ◀─ gather "written" ─ commit (then the caller acknowledges)
    load(path) ─ scatter LOAD(path) ─ load_rank ──────────────────────▶ load_rank
    weights.named_parameters() ─ scatter GATHER ─ full_tensor() each ─▶ the same all-gathers
    keepalive (idle) ─ scatter NOOP;   stop ─ scatter STOP, leave ──────▶ return, leave (exit 0)

At world size 1 the same calls run with every collective the identity. A share is a list of
TrainSamples (numpy), balanced by tokens (prompt + response: the compute of a row) so that the
ranks finish together; each rank pads its own batch.

Failure: a rank that dies breaks the next collective of the others (gloo reports the closed
connection; any collective times out after distributed_timeout_s), the leader's worker stops
with an error and torchrun restarts the whole group from the last checkpoint (`--max-restarts`):
nothing the dead step consumed was acknowledged. A follower ends when the leader says STOP, or
with an error when the leader is gone (so torchrun sees the failure).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.learner.checkpoint import CheckpointStore, LearnerState, write_rank
from services.learner.sharding import FullWeights, gather_all
from services.learner.step_records import StepPlan, StepResult
from services.learner.trainer import Trainer
from shellrl.rl.batch import TrainSample, build_batch
from shellrl.rl.losses import LossStats

log = logging.getLogger(__name__)

KEEPALIVE_S = 60.0  # an idle leader tells the followers it lives this often (or timeout / 4)


@dataclass(frozen=True)
class Command:
    """One message from the leader to a rank. kind: step, skip, save, load, gather, noop, stop."""

    kind: str
    payload: Any = None


@dataclass(frozen=True)
class Share:
    """A rank's part of one step: its samples, the plan every rank follows, batch padding."""

    samples: list[TrainSample]
    learner_version: int
    plan: StepPlan
    pad_token_id: int
    pad_to_multiple_of: int


def split_by_tokens(samples: list[TrainSample], world_size: int) -> list[list[TrainSample]]:
    """`world_size` shares with token counts (prompt + response) as equal as a greedy split
    makes them: the longest sample first, each to the share with the fewest tokens so far
    (ties: the lowest rank). Each share keeps the samples' original order. Some shares are
    empty when there are fewer samples than ranks."""
    loads, owners = [0] * world_size, {}
    by_length = sorted(range(len(samples)), key=lambda i: -_tokens(samples[i]))
    for i in by_length:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += _tokens(samples[i])
    return [[s for i, s in enumerate(samples) if owners[i] == r] for r in range(world_size)]


def _tokens(sample: TrainSample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


def train_share(trainer: Trainer, share: Share) -> StepResult:
    """Every rank: build this rank's batch (None when its share is empty) and train it."""
    batch = None
    if share.samples:
        batch = build_batch(share.samples, share.pad_token_id, share.pad_to_multiple_of)
    return trainer.step(batch, share.learner_version, share.plan)


def merge_results(results: list[StepResult]) -> StepResult:
    """One step's result from every rank's: loss terms and counts summed, parity over all
    fresh tokens, every rank's rows' KL, the leader's LR and gradient norm (the norm is global)."""
    if len(results) == 1:
        return results[0]
    lead = results[0]
    totals = sum((r.totals for r in results), LossStats())
    fresh = sum(r.parity_tokens for r in results)
    parity_sum = sum(r.parity_mean * r.parity_tokens for r in results)
    return replace(
        lead,
        stats={**totals.summary(), "grad_norm": lead.grad_norm},
        parity_mean=parity_sum / fresh if fresh else 0.0,
        parity_max=max(r.parity_max for r in results),
        parity_tokens=fresh,
        sequences=sum(r.sequences for r in results),
        tokens=sum(r.tokens for r in results),
        duration_s=max(r.duration_s for r in results),
        totals=totals,
        row_kl=tuple(row for r in results for row in r.row_kl),
    )


class DataParallel:
    """The leader's handle on every rank (blocking calls: run them off the event loop).
    trainer: rank 0's; store: where checkpoints go; pad_token_id, pad_to_multiple_of: batches."""

    def __init__(
        self,
        trainer: Trainer,
        store: CheckpointStore,
        *,
        pad_token_id: int,
        pad_to_multiple_of: int = 1,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.trainer, self.store, self.ranks = trainer, store, trainer.ranks
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of
        self.keepalive_s = min(keepalive_s, self.ranks.timeout_s / 4)
        self._last_sent = time.monotonic()
        # what WeightSync reads: the model itself, or its full weights gathered from every rank
        self.weights = trainer.model
        if trainer.sharded:
            self.weights = FullWeights(trainer.model, lambda: self._send("gather"))

    def _send(self, kind: str, payloads: list | None = None) -> Any:
        """Scatter one command per rank (the same one when `payloads` is None); returns ours."""
        self._last_sent = time.monotonic()
        n = self.ranks.world_size
        messages = [Command(kind, p) for p in payloads] if payloads else [Command(kind)] * n
        return self.ranks.scatter(messages).payload

    def step(self, samples: list[TrainSample], learner_version: int) -> StepResult:
        """One optimizer step on `samples` (advantages set) across every rank."""
        shares = split_by_tokens(samples, self.ranks.world_size)
        plan = StepPlan.of(shares, self.trainer.config.micro_batch_size)
        mine = self._send(
            "step",
            [
                Share(s, learner_version, plan, self.pad_token_id, self.pad_to_multiple_of)
                for s in shares
            ],
        )
        return merge_results(self.ranks.gather(train_share(self.trainer, mine)))

    def skip_step(self) -> None:
        """A step without trainable data on every rank (Trainer.skip_step)."""
        self._send("skip")
        self.trainer.skip_step()

    def save(self, state: LearnerState) -> Path:
        """A checkpoint of every rank (see checkpoint.py); returns its directory once complete."""
        tmp = self.store.begin(state.step)
        self._send("save", [tmp] * self.ranks.world_size)
        write_rank(self.trainer, tmp, self.store.model_source)
        self.ranks.gather("written")  # every rank's files are in place (and fsynced)
        return self.store.commit(tmp, state)

    def load(self, path: Path) -> LearnerState:
        """Every rank resumes from checkpoint `path`; returns its LearnerState."""
        self._send("load", [path] * self.ranks.world_size)
        return self.store.load(path, self.trainer)

    def keepalive_due(self) -> bool:
        return self.ranks.world_size > 1 and time.monotonic() - self._last_sent >= self.keepalive_s

    def keepalive(self) -> None:
        """Tell idle followers the leader lives (they wait for commands within a timeout)."""
        self._send("noop")

    def release_followers(self) -> None:
        """The followers return from `follow` (they may `follow` again)."""
        if self.ranks.world_size > 1:
            self._send("stop")

    def stop(self) -> None:
        """The followers return from `follow` and every rank leaves the process group together
        (`Ranks.close(together=True)`, which each follower calls after STOP); call once, at the
        end of the run."""
        if self.ranks.world_size > 1:
            self.release_followers()
            self.ranks.close(together=True)


def follow(trainer: Trainer, store: CheckpointStore) -> None:
    """A follower's loop: carry out the leader's commands until STOP (see the module docstring).
    Raises when a collective fails (the leader died or hangs): torchrun then restarts the group."""
    ranks = trainer.ranks
    while True:
        command = ranks.scatter(None)
        if command.kind == "stop":
            return
        if command.kind == "step":
            ranks.gather(train_share(trainer, command.payload))
        elif command.kind == "skip":
            trainer.skip_step()
        elif command.kind == "save":
            write_rank(trainer, command.payload, store.model_source)
            ranks.gather("written")
        elif command.kind == "load":
            store.load(command.payload, trainer)
        elif command.kind == "gather":
            gather_all(trainer.model)
        elif command.kind != "noop":
            raise ValueError(f"unknown command from the leader: {command.kind!r}")
