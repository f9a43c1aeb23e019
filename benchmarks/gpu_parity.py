"""Log-prob parity on GPU: learner (bf16 model, float32 per-sequence log-probs) vs engine (bf16), issue 9.

1. Push the learner's weights to the engine (CudaIpcBucket), version v.
2. The engine samples `--parity-prompts` random prompts x `--parity-new-tokens` tokens at T = 0.7
   (ignore_eos), returning the behavior log-prob of each token.
3. The learner scores the same tokens with shellrl.rl.logprobs.token_logprobs at the same T:
   mean and max |learner - engine|. Controls on the same tokens: T = 1 on the learner side
   (known_pitfalls C07: must be clearly further), and a bf16 LM head (what bf16 logits give).
4. One services.learner.trainer.Trainer step (AdamW, lr 1e-3: large, so the control below is far)
   on those samples; push version v+1; sample again; the same check with the new weights, and a
   stale control (the pre-step weights scoring the new version's tokens).
5. A second Trainer step on the new samples: its own parity statistic (Trainer's, over tokens of
   the version it trains) is reported too; together this is the two-step training run.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from rich.table import Table

from shellrl.rl.batch import TrainBatch, TrainSample, build_batch
from shellrl.rl.logprobs import GREEDY_TEMPERATURE, token_logprobs
from shellrl.weights import gpu as wtg
from shellrl.weights.pinned import PinnedHostBucket

TEMPERATURE = 0.7
PAD_ID = 2


async def push(model, bucket, client, url: str, version: int) -> float:
    """Send the model's weights as `version`; returns seconds until the engine reports it."""
    t0 = time.perf_counter()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    payload = (
        bucket.fill(named, staging="bucket")
        if isinstance(bucket, wtg.CudaIpcBucket)
        else bucket.fill(named)
    )
    await client.update_weights_from_tensor([payload], weight_version=str(version), urls=[url])
    got = (await client.get_weight_version(urls=[url]))[url]
    if got != str(version):
        raise RuntimeError(f"engine reports version {got!r} after pushing {version}")
    return time.perf_counter() - t0


async def sample(
    client, url: str, n: int, new_tokens: int, vocab: int, seed: int, version: int
) -> TrainBatch:
    """n engine samples as a TrainBatch (behavior log-probs, T, policy version on every response token)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(16, 65))).tolist() for _ in range(n)]
    params = {"temperature": TEMPERATURE, "max_new_tokens": new_tokens, "ignore_eos": True}
    results = await asyncio.gather(*(client.generate(p, params, url=url) for p in prompts))
    samples = []
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if r.weight_version != str(version) or len(r.output_logprobs) != len(r.output_ids):
            raise RuntimeError(
                f"sample {i}: version {r.weight_version!r} (expected {version}), "
                f"{len(r.output_ids)} tokens, {len(r.output_logprobs)} log-probs"
            )
        k = len(r.output_ids)
        samples.append(
            TrainSample(
                trajectory_id=f"s{seed}-{i}",
                prompt_ids=np.asarray(prompt),
                response_ids=np.asarray(r.output_ids),
                behavior_logprobs=np.asarray(r.output_logprobs, dtype=np.float32),
                loss_mask=np.ones(k, np.float32),
                policy_versions=np.full(k, version, np.int64),
                temperatures=np.full(k, TEMPERATURE, np.float32),
                advantage=1.0 if i % 2 == 0 else -1.0,
            )
        )
    return build_batch(samples, PAD_ID)


@torch.no_grad()
def score(
    model, batch: TrainBatch, *, temperature: float | None = None, bf16_head: bool = False
) -> torch.Tensor:
    """[B, L-1] learner log-probs: token_logprobs (float32 head), or the controls (see the module docstring)."""
    if temperature is not None:
        batch = replace(batch, temperatures=torch.full_like(batch.temperatures, temperature))
    out = torch.zeros_like(batch.loss_mask)
    for lo in range(0, batch.size, 8):
        mb = batch.rows(lo, min(lo + 8, batch.size))
        width = mb.loss_mask.shape[1]
        if not bf16_head:
            out[lo : lo + mb.size, :width] = token_logprobs(model, mb)
            continue
        hidden = model.get_decoder()(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            use_cache=False,
        ).last_hidden_state[:, :-1]
        weight = model.get_output_embeddings().weight
        for i in range(mb.size):
            idx = (mb.loss_mask[i] > 0).nonzero().squeeze(-1)
            t = mb.temperatures[i, idx].clamp(min=GREEDY_TEMPERATURE)
            logits = (
                F.linear(hidden[i, idx], weight).float() / t[:, None]
            )  # bf16 logits, as a bf16 engine head
            out[lo + i, idx] = (
                logits.log_softmax(-1).gather(-1, mb.target_ids[i, idx, None]).squeeze(-1)
            )
    return out


def gap(learner: torch.Tensor, batch: TrainBatch) -> dict:
    """mean / max |learner - engine| over the scored tokens, in nats."""
    mask = batch.loss_mask > 0
    diff = (learner - batch.behavior_logprobs)[mask].abs().double()
    return {
        "mean": float(diff.mean()),
        "max": float(diff.max()),
        "p99": float(diff.quantile(0.99)),
        "tokens": int(mask.sum()),
    }


async def scale_sweep(model, bucket, client, url: str, args, version: int) -> dict:
    """Parity vs the logit scale: the final norm's weight set for logit std 0.6 (the random init),
    2 and 4 (the main run), 16 prompts x 128 tokens each; the weights are restored afterwards."""
    norm = model.model.norm.weight
    kept = norm.detach().clone()
    base = 1.0 / (model.config.initializer_range * model.config.hidden_size**0.5)
    out = {}
    try:
        for i, logit_std in enumerate((None, 2.0, 4.0)):
            with torch.no_grad():
                norm.fill_(1.0 if logit_std is None else logit_std * base)
            await push(model, bucket, client, url, version + i)
            batch = (
                await sample(client, url, 16, 128, model.config.vocab_size, 100 + i, version + i)
            ).to(norm.device)
            out["init" if logit_std is None else f"logit_std_{logit_std:g}"] = {
                **gap(score(model, batch), batch),
                "mean_behavior_logprob": float(batch.behavior_logprobs[batch.loss_mask > 0].mean()),
            }
    finally:
        with torch.no_grad():
            norm.copy_(kept)
    return out


async def parity_section(model, client, url: str, args, version: int) -> dict:
    from services.learner.trainer import Trainer
    from services.learner.trainer_config import TrainerConfig

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    bucket = wtg.CudaIpcBucket(args.engine_device) if device.type == "cuda" else PinnedHostBucket()
    out: dict = {"temperature": TEMPERATURE, "lr": 1e-3}
    try:
        await push(model, bucket, client, url, version)
        t0 = time.perf_counter()
        batch1 = (
            await sample(
                client, url, args.parity_prompts, args.parity_new_tokens, vocab, 1, version
            )
        ).to(device)
        out["sample_s"] = time.perf_counter() - t0
        out["mean_behavior_logprob"] = float(batch1.behavior_logprobs[batch1.loss_mask > 0].mean())
        learner = score(model, batch1)
        out["before"] = {
            "learner_fp32": gap(learner, batch1),
            "control_T1": gap(score(model, batch1, temperature=1.0), batch1),
            "control_bf16_head": gap(score(model, batch1, bf16_head=True), batch1),
        }
        # Which side is noisier: both against the same weights run entirely in float32.
        reference = copy.deepcopy(model).float()
        truth = score(reference, batch1)
        del reference
        out["vs_float32_model"] = {
            "engine": gap(truth, batch1),
            "learner_bf16": gap(truth, replace(batch1, behavior_logprobs=learner)),
        }
        out["logit_scale_sweep"] = await scale_sweep(
            model, bucket, client, url, args, version + 100
        )
        await push(model, bucket, client, url, version)
        stale = copy.deepcopy(model)
        trainer = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_size=8, grad_clip_norm=1.0))
        step1 = trainer.step(batch1, learner_version=version)
        out["step1"] = {
            "parity_mean": step1.parity_mean,
            "parity_max": step1.parity_max,
            "parity_tokens": step1.parity_tokens,
            "grad_norm": step1.grad_norm,
            "duration_s": step1.duration_s,
        }
        out["push_after_step_s"] = await push(model, bucket, client, url, version + 1)
        batch2 = (
            await sample(
                client, url, args.parity_prompts, args.parity_new_tokens, vocab, 2, version + 1
            )
        ).to(device)
        out["after"] = {
            "learner_fp32": gap(score(model, batch2), batch2),
            "control_stale_weights": gap(score(stale, batch2), batch2),
        }
        del stale
        step2 = trainer.step(batch2, learner_version=version + 1)
        out["step2"] = {
            "parity_mean": step2.parity_mean,
            "parity_max": step2.parity_max,
            "parity_tokens": step2.parity_tokens,
            "grad_norm": step2.grad_norm,
            "duration_s": step2.duration_s,
        }
        del trainer
    finally:
        bucket.close()
    return out


def parity_table(parity: dict) -> Table:
    table = Table(
        title=f"Log-prob parity learner vs engine, |delta| in nats (T = {parity.get('temperature')})"
    )
    for col in ("when", "learner scoring", "tokens", "mean", "p99", "max"):
        table.add_column(col, justify="left" if col in ("when", "learner scoring") else "right")
    if "error" in parity:
        table.add_row("failed", parity["error"][:100], "", "", "", "")
        return table
    for when in ("before", "after"):
        for name, g in parity.get(when, {}).items():
            table.add_row(
                f"{when} the step",
                name,
                str(g["tokens"]),
                f"{g['mean']:.4f}",
                f"{g['p99']:.4f}",
                f"{g['max']:.4f}",
            )
    for name, g in parity.get("vs_float32_model", {}).items():
        table.add_row(
            "before the step",
            f"{name} vs the same weights in float32",
            str(g["tokens"]),
            f"{g['mean']:.4f}",
            f"{g['p99']:.4f}",
            f"{g['max']:.4f}",
        )
    for name, g in parity.get("logit_scale_sweep", {}).items():
        table.add_row(
            f"sweep {name} (mean lp {g['mean_behavior_logprob']:.2f})",
            "learner_fp32",
            str(g["tokens"]),
            f"{g['mean']:.4f}",
            f"{g['p99']:.4f}",
            f"{g['max']:.4f}",
        )
    for step in ("step1", "step2"):
        s = parity.get(step)
        if s:
            table.add_row(
                f"Trainer {step}",
                "StepResult.parity (train mode)",
                str(s["parity_tokens"]),
                f"{s['parity_mean']:.4f}",
                "",
                f"{s['parity_max']:.4f}",
            )
    return table
