"""The main job's learner step on CPU, variants interleaved (issue 33 item 3).

`python -m benchmarks learner_step -- [--groups 1] [--threads 1] [--repeats 3] [--variants ...]`
(`--quick`: the tiny model, a smoke run of seconds).

The step is the main job's (cli/main_job.py): SmolLM2-135M-Instruct in float32, one GRPO group of
G = 8 per micro-batch, its prompt run once (shared prefix, no activation checkpointing), k3 KL to
the initial policy with kl_coef 0.1, lr 2e-5, one AdamW update (ppo_epochs 1: the proximal
log-probs come from the same forward). Each group is the rollout service's real prompt for a
curriculum task and 8 responses the model itself samples at T = 0.7 (so the log-probs are those
of plausible tokens, not of random ones), laid out as two turns: a scored action of 15-40 tokens,
an unscored observation of 20-80, a scored action of 8-40; the batch is padded to a multiple of
64 tokens as the learner's worker pads it (SHELLRL_PAD_TO_MULTIPLE_OF).

Every variant is a `Trainer` (services/learner/trainer.py) built from the same initial weights;
`--repeats` rounds each time every variant once, in turn (so load from other processes falls on
all of them alike), after one warm-up step each. Printed: per variant the median step seconds
(wall) and CPU seconds of this process (time.process_time: with one torch thread, the step's own
work, little moved by other processes' load), each with its ratio to the first variant measured
in the same run, and, from the first step of each variant
on the same weights and batch, what it changes against the first: the loss, the KL term, the
gradient (max |difference| relative to the largest gradient entry, cosine) and, for a variant with
a bfloat16 reference, the reference log-probs (max and mean |difference| in nats over scored
tokens). The behaviour log-probs are the float32 learner's, so at that first step w = r = 1 and
the loss's policy term is -sum(A * weight) for any weights: the KL and the gradient are what
compare the variants' computations. Variants (`name=field:value,...` of TrainerConfig, or a preset name):

  before                  the step before issue 33: AdamW's per-tensor loop, padded rows,
                          float32 reference
  fused                   AdamW fused
  fused_unpadded          AdamW fused, each row's own tokens unpadded after the shared prefix
                          (the default since)
  fused_unpadded_bf16ref  that, with the reference's decoder under bfloat16 autocast
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

console = Console(width=140)

PRESETS = {
    "before": {"fused_optimizer": False, "unpadded_rows": False, "reference_dtype": "float32"},
    "fused": {"fused_optimizer": True, "unpadded_rows": False, "reference_dtype": "float32"},
    "fused_unpadded": {
        "fused_optimizer": True,
        "unpadded_rows": True,
        "reference_dtype": "float32",
    },
    "fused_unpadded_bf16ref": {
        "fused_optimizer": True,
        "unpadded_rows": True,
        "reference_dtype": "bfloat16",
    },
}


PAD_TO_MULTIPLE_OF = 64  # the learner's SHELLRL_PAD_TO_MULTIPLE_OF default (the worker's batches)


def main_job_config():
    """The main job's TrainerConfig (cli/main_job.py's learner environment, LearnerSettings)."""
    from services.learner.trainer_config import TrainerConfig
    from shellrl.rl.losses import PPOConfig

    return TrainerConfig(
        lr=2e-5,
        micro_batch_size=8,
        gradient_checkpointing=False,
        share_prefix_min_tokens=32,
        loss=PPOConfig(kl_coef=0.1),
    )


def main_job_batch(model, model_path: str, groups: int, seed: int = 0):
    """`groups` groups of 8 (see the module docstring): a TrainBatch of 8 * groups rows."""
    from cli.job_tasks import CURRICULUM_TEMPLATES
    from services.rollout.prompt import ChatFormat, load_chat_tokenizer
    from shellrl.models import resolve_model_path
    from shellrl.rl.batch import TrainSample, build_batch
    from tasksets.generator import generate

    chat = ChatFormat.from_tokenizer(load_chat_tokenizer(str(resolve_model_path(model_path))))
    tasks = [t for t in generate("train", seed=seed) if t.template in CURRICULUM_TEMPLATES]
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    samples = []
    for g, task in enumerate(tasks[:groups]):
        prompt = torch.tensor([chat.prompt_ids(task.instruction)] * 8)
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=0.7,
                min_new_tokens=160,
                max_new_tokens=160,
                pad_token_id=2,
            )
        for i in range(8):
            a1, o1, a2 = (int(rng.integers(lo, hi)) for lo, hi in ((15, 41), (20, 81), (8, 41)))
            r = a1 + o1 + a2
            mask = np.r_[np.ones(a1), np.zeros(o1), np.ones(a2)].astype(np.uint8)
            samples.append(
                TrainSample(
                    trajectory_id=f"g{g}-{i}",
                    prompt_ids=prompt[i].numpy(),
                    response_ids=out[i, prompt.shape[1] : prompt.shape[1] + r].numpy(),
                    behavior_logprobs=np.zeros(r, np.float32),
                    loss_mask=mask,
                    policy_versions=np.where(mask > 0, 0, -1),
                    temperatures=np.full(r, 0.7, np.float32),
                    advantage=float(rng.normal()),
                )
            )
    return build_batch(samples, pad_token_id=2, pad_to_multiple_of=PAD_TO_MULTIPLE_OF)


def with_behavior(batch, trainer):
    """The batch with behavior log-probs = the float32 learner's (as the engine's would be)."""
    return replace(batch, behavior_logprobs=trainer.logprobs(batch) * batch.loss_mask)


def first_step_terms(trainer, batch) -> dict:
    """Loss, KL and flat gradient of the step `trainer` would take on `batch` (not applied)."""
    from shellrl.rl.losses import loss_weights

    cfg = trainer.config
    weights = loss_weights(batch.loss_mask, cfg.loss.aggregation)
    proximal = torch.zeros_like(batch.loss_mask)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = kl = 0.0
    for lo in range(0, batch.size, cfg.micro_batch_size):
        hi = min(lo + cfg.micro_batch_size, batch.size)
        stats = trainer._accumulate(batch.rows(lo, hi), lo, hi, weights, proximal, kls=[])
        loss, kl = loss + stats.policy_loss, kl + stats.kl
    grad = torch.cat([p.grad.flatten() for p in trainer.params if p.grad is not None]).clone()
    trainer.optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "kl": kl, "grad": grad}


def reference_logprobs(trainer, batch) -> torch.Tensor:
    """[B, L-1] float32 log-probs under `trainer`'s reference, as its step computes them."""
    out = torch.zeros_like(batch.loss_mask)
    mbs = trainer.config.micro_batch_size
    for lo in range(0, batch.size, mbs):
        mb = batch.rows(lo, min(lo + mbs, batch.size))
        with torch.no_grad(), trainer._reference_autocast():
            out[lo : lo + mb.size, : mb.loss_mask.shape[1]] = trainer.reference_policy(mb)
    return out


def parse_variant(text: str) -> tuple[str, dict]:
    if text in PRESETS:
        return text, PRESETS[text]
    name, _, fields = text.partition("=")
    values = {}
    for item in filter(None, fields.split(",")):
        key, _, raw = item.partition(":")
        values[key] = {"true": True, "false": False}.get(raw, raw)
    return name, values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks learner_step", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--groups", type=int, default=1, help="GRPO groups of 8 per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the job: 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-path", default="smollm2")
    parser.add_argument("--variants", nargs="+", default=list(PRESETS))
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_path, args.repeats = "tiny", 1
    torch.set_num_threads(args.threads)

    from services.learner.trainer import Trainer
    from shellrl.models import load_model

    initial = load_model(args.model_path)
    batch = main_job_batch(initial, args.model_path, args.groups)
    variants = [parse_variant(v) for v in args.variants]
    base_cfg = main_job_config()
    trainers = {
        name: Trainer(copy.deepcopy(initial), replace(base_cfg, **values))
        for name, values in variants
    }
    del initial
    first = next(iter(trainers.values()))
    batch = with_behavior(batch, first)
    terms = {name: first_step_terms(t, batch) for name, t in trainers.items()}
    ref0 = reference_logprobs(first, batch)
    scored = batch.loss_mask > 0
    times: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    for name, t in trainers.items():  # warm-up
        t.step(batch, 0)
    for _ in range(args.repeats):
        for name, t in trainers.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            t.step(batch, 0)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            print(f"{name}: {times[name][-1]:.2f} s, {cpu[name][-1]:.2f} CPU s", flush=True)
    lengths = batch.lengths.tolist()
    table = Table(
        title=f"learner step, main job shapes: {args.groups} group(s) of 8, rows of "
        f"{min(lengths)}-{max(lengths)} tokens, {batch.num_loss_tokens} scored, "
        f"{args.threads} thread(s), median of {args.repeats} interleaved"
    )
    columns = ("variant", "step s", "vs first", "CPU s", "vs first", "loss", "kl")
    for col in (*columns, "grad max rel diff", "grad cos"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    base_t, base = statistics.median(times[variants[0][0]]), terms[variants[0][0]]
    base_cpu = statistics.median(cpu[variants[0][0]])
    for name, t in trainers.items():
        med, term = statistics.median(times[name]), terms[name]
        med_cpu = statistics.median(cpu[name])
        diff = (term["grad"] - base["grad"]).abs().max() / base["grad"].abs().max()
        cos = torch.nn.functional.cosine_similarity(
            term["grad"].double(), base["grad"].double(), dim=0
        )
        table.add_row(
            name,
            f"{med:.2f}",
            f"{med / base_t:.3f}x",
            f"{med_cpu:.2f}",
            f"{med_cpu / base_cpu:.3f}x",
            f"{term['loss']:.6f}",
            f"{term['kl']:.6f}",
            f"{float(diff):.2e}",
            f"{float(cos):.6f}",
        )
        if t.config.reference_dtype != first.config.reference_dtype:
            d = (reference_logprobs(t, batch) - ref0)[scored].abs()
            console.print(
                f"{name}: reference log-probs vs {variants[0][0]}: max |diff| "
                f"{float(d.max()):.4f}, mean {float(d.mean()):.4f} nats over {int(scored.sum())} "
                f"scored tokens (mean log-prob {float(ref0[scored].mean()):.3f})"
            )
    console.print(table)
    console.print({name: [round(x, 2) for x in v] for name, v in times.items()})
    console.print({f"{name} CPU": [round(x, 2) for x in v] for name, v in cpu.items()})


if __name__ == "__main__":
    main()
