"""KL to the initial policy on given token sequences (issue 33 item 1: eval episodes), for
`POST /v1/kl` while the learner is paused.

Consumes sequences (a prompt's token ids, the response's token ids and which of them the model
sampled: the ACTION tokens of an episode); produces, per sequence, the sum of the k3 estimate of
KL(pi || ref) over its sampled tokens and their count, at temperature 1, from one no-grad forward
of the current policy and one of the frozen reference (the trainer's own; shellrl.rl.losses.row_kl,
the term the loss adds). Guarantees: the weights are not touched (no-grad, no optimizer); one
process only (a sharded learner's forwards are collectives every rank would have to join).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, Field

from shellrl.rl.batch import TrainSample, build_batch
from shellrl.rl.losses import row_kl

MAX_SEQUENCES = 512
MAX_TOKENS = 8192  # per sequence, prompt and response together


class KlSequence(BaseModel):
    """One sequence of `POST /v1/kl`: prompt_ids, response_ids and a 0/1 `loss_mask` per response
    token (1: sampled by the model, scored)."""

    prompt_ids: list[int] = Field(min_length=1, max_length=MAX_TOKENS)
    response_ids: list[int] = Field(max_length=MAX_TOKENS)
    loss_mask: list[int] = Field(max_length=MAX_TOKENS)


class KlRequest(BaseModel):
    sequences: list[KlSequence] = Field(min_length=1, max_length=MAX_SEQUENCES)


@dataclass(frozen=True)
class SequenceKl:
    kl_sum: float
    tokens: int


def sequences_kl(trainer, sequences: list[KlSequence], pad_token_id: int) -> list[SequenceKl]:
    """Per sequence: KL(pi || ref) summed over its scored tokens, and their count (module
    docstring). trainer: services.learner.trainer.Trainer with a reference (kl_coef > 0), not
    sharded. Raises ValueError for a sequence whose loss_mask and response differ in length."""
    samples = []
    for i, s in enumerate(sequences):
        if len(s.loss_mask) != len(s.response_ids):
            raise ValueError(f"sequences[{i}]: loss_mask and response_ids differ in length")
        r = len(s.response_ids)
        samples.append(
            TrainSample(
                trajectory_id=str(i),
                prompt_ids=np.asarray(s.prompt_ids, np.int64),
                response_ids=np.asarray(s.response_ids, np.int64),
                behavior_logprobs=np.zeros(r, np.float32),
                loss_mask=(np.asarray(s.loss_mask) > 0).astype(np.uint8),
                policy_versions=np.full(r, -1),
                temperatures=np.ones(r, np.float32),
                advantage=0.0,
            )
        )
    out: list[SequenceKl] = []
    mbs = trainer.config.micro_batch_size
    for lo in range(0, len(samples), mbs):  # one micro-batch at a time: memory as a step's
        batch = build_batch(samples[lo : lo + mbs], pad_token_id=pad_token_id)
        logp = trainer.logprobs(batch)
        with torch.no_grad(), trainer._reference_autocast():
            ref = trainer.reference_policy(batch.to(trainer.params[0].device))
        mask = batch.loss_mask.to(logp.device)
        sums, counts = row_kl(logp, ref, mask, trainer.config.loss.max_log_ratio)
        out += [SequenceKl(float(k), int(n)) for k, n in zip(sums.tolist(), counts.tolist())]
    return out
