"""Learner memory on GPU: log-prob + backward at B = 8, L = 1000 for three ways of computing the
log-probs (issue 9), on a Qwen2.5-0.5B-shaped bf16 model with activation checkpointing on its
decoder layers (the Trainer's setting):

  fp32_per_sequence   shellrl.rl.logprobs.token_logprobs: LM head per sequence in chunks of 1024
                      positions, float32, under checkpointing (the project's path)
  fp32_whole_batch    one float32 LM head over the whole batch: [B, L-1, V] float32 logits
  bf16_cross_entropy  the model's own bf16 logits [B, L, V] and F.cross_entropy in bf16

Each runs forward + backward of the mean log-prob 4 times (first one a warm-up); reported: peak
allocated GPU memory (absolute, and above the weights), median seconds, and the error of its
log-probs against a float64 LM head on a slice (sequence 0, the first 256 scored positions, i.e.
response tokens; same bf16 hidden states, so only the head's precision differs).
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from rich.table import Table

from shellrl.rl.batch import TrainSample, build_batch
from shellrl.rl.logprobs import enable_gradient_checkpointing, token_logprobs

BATCH, LENGTH, PROMPT = 8, 1000, 100
SLICE = slice(PROMPT - 1, PROMPT - 1 + 256)  # columns of sequence 0 that score response tokens


def fp32_per_sequence(model, batch):
    return token_logprobs(model, batch)


def fp32_whole_batch(model, batch):
    hidden = model.get_decoder()(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).last_hidden_state[:, :-1]
    logits = F.linear(hidden.float(), model.get_output_embeddings().weight.float())
    return logits.gather(-1, batch.target_ids[..., None]).squeeze(-1) - logits.logsumexp(-1)


def bf16_cross_entropy(model, batch):
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    ).logits[:, :-1]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.target_ids.reshape(-1), reduction="none"
    )
    return -ce.view(batch.target_ids.shape).float()


METHODS = {
    "fp32_per_sequence": fp32_per_sequence,
    "fp32_whole_batch": fp32_whole_batch,
    "bf16_cross_entropy": bf16_cross_entropy,
}


def _batch(vocab: int, device):
    rng = np.random.default_rng(0)
    samples = []
    for i in range(BATCH):
        r = LENGTH - PROMPT
        samples.append(
            TrainSample(
                trajectory_id=f"m{i}",
                prompt_ids=rng.integers(3, vocab, PROMPT),
                response_ids=rng.integers(3, vocab, r),
                behavior_logprobs=np.zeros(r, np.float32),
                loss_mask=np.ones(r, np.float32),
                policy_versions=np.zeros(r, np.int64),
                temperatures=np.ones(r, np.float32),
                advantage=1.0,
            )
        )
    return build_batch(samples, 2).to(device)


@torch.no_grad()
def _reference(model, batch) -> torch.Tensor:
    hidden = model.get_decoder()(
        input_ids=batch.input_ids[:1],
        attention_mask=batch.attention_mask[:1],
        position_ids=batch.position_ids[:1],
        use_cache=False,
    ).last_hidden_state[0, SLICE]
    logits = F.linear(hidden.double(), model.get_output_embeddings().weight.double())
    return logits.log_softmax(-1).gather(-1, batch.target_ids[0, SLICE, None]).squeeze(-1)


def measure(model, batch, fn, repeats: int = 4) -> dict:
    device = batch.input_ids.device
    mask = batch.loss_mask
    times, peaks, above = [], [], []
    values = None
    for i in range(repeats):
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        logp = fn(model, batch)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device)
        peaks.append(peak)
        above.append(peak - base)
        values = logp.detach()[0, SLICE].double()
        del logp, loss
    model.zero_grad(set_to_none=True)
    return {
        "peak_gb": max(peaks) / 1e9,
        "peak_above_weights_gb": max(above) / 1e9,
        "median_s": statistics.median(times),
        "values": values,
    }


def memory_section(args) -> dict:
    from benchmarks.model_shapes import random_model

    device = torch.device(args.learner_device)
    gc.collect()
    torch.cuda.empty_cache()
    model = random_model(args.memory_shape, device=str(device), logit_std=4.0)
    enable_gradient_checkpointing(model)
    model.train()
    batch = _batch(model.config.vocab_size, device)
    reference = _reference(model, batch)
    out = {
        "shape": args.memory_shape,
        "batch": BATCH,
        "length": LENGTH,
        "scored_tokens": int(batch.num_loss_tokens),
        "weights_gb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
        "methods": {},
    }
    for name, fn in METHODS.items():
        try:
            r = measure(model, batch, fn)
            err = (r.pop("values") - reference).abs()
            r.update({"vs_fp64_mean": float(err.mean()), "vs_fp64_max": float(err.max())})
        except torch.OutOfMemoryError as exc:
            r = {"error": f"out of memory: {exc}"[:300]}
        out["methods"][name] = r
        gc.collect()
        torch.cuda.empty_cache()
    del model, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def memory_table(memory: dict) -> Table:
    table = Table(
        title=f"Learner log-prob + backward, B={memory.get('batch')} L={memory.get('length')} "
        f"({memory.get('shape')}, bf16 weights {memory.get('weights_gb', 0):.2f} GB)"
    )
    for col in (
        "method",
        "peak GB",
        "peak above weights GB",
        "median s",
        "vs fp64 mean",
        "vs fp64 max",
    ):
        table.add_column(col, justify="left" if col == "method" else "right")
    if "error" in memory:
        table.add_row("failed", memory["error"][:100], "", "", "", "")
        return table
    for name, r in memory.get("methods", {}).items():
        if "error" in r:
            table.add_row(name, r["error"][:60], "", "", "", "")
            continue
        table.add_row(
            name,
            f"{r['peak_gb']:.2f}",
            f"{r['peak_above_weights_gb']:.2f}",
            f"{r['median_s']:.3f}",
            f"{r['vs_fp64_mean']:.2e}",
            f"{r['vs_fp64_max']:.2e}",
        )
    return table
