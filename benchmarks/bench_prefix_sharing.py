"""Learner forward+backward of one GRPO group with and without the shared-prefix forward.

A group of G trajectories of one task shares its whole prompt (system prompt, the worked examples,
the task): `shellrl.rl.logprobs` can run that prefix through the decoder once, at batch 1, with its
KV cache, and only each trajectory's own tokens at batch G. This measures, in one run on the real
SmolLM2-135M (float32, CPU), the time of `token_logprobs` + backward for one group:
  * full forward with activation checkpointing (the learner's default),
  * full forward without checkpointing,
  * shared prefix (needs no checkpointing),
and checks that the shared-prefix log-probs equal the full forward's. The prompt is the rollout
service's real one (services/rollout/prompt.py) for a generated task; responses are random tokens of
`--response-tokens` (the agent's actions and tool outputs).

Run: `python -m benchmarks prefix_sharing` (or `make bench ARGS="prefix_sharing"`; `--quick`: the
tiny test model, a group of 2).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

console = Console(width=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks prefix_sharing", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--response-tokens", type=int, default=120, help="mean own tokens per trajectory"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-path", default="smollm2")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model, G=2, ~16 own tokens, 1 repeat (a smoke run: seconds)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.model_path, args.group_size, args.response_tokens, args.repeats = "tiny", 2, 16, 1
    torch.set_num_threads(args.threads)

    from services.rollout.prompt import ChatFormat, load_chat_tokenizer
    from shellrl.models import load_model, resolve_model_path
    from shellrl.rl.batch import TrainSample, build_batch
    from shellrl.rl.logprobs import (
        enable_gradient_checkpointing,
        shared_prefix_length,
        token_logprobs,
    )
    from tasksets.generator import generate

    path = resolve_model_path(args.model_path)
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer(str(path)))
    task = generate("train", count=1, seed=0)[0]
    prompt = np.asarray(chat.prompt_ids(task.instruction))
    rng = np.random.default_rng(0)
    samples = []
    for i in range(args.group_size):
        r = int(rng.integers(args.response_tokens // 2, args.response_tokens * 3 // 2))
        samples.append(
            TrainSample(
                f"t{i}",
                prompt,
                rng.integers(3, 49000, r),
                np.zeros(r, np.float32),
                np.ones(r, np.uint8),
                np.zeros(r, np.int64),
                np.ones(r, np.float32),
                float(rng.normal()),
            )
        )
    batch = build_batch(samples, pad_token_id=2)
    rows = {}
    values = {}
    for name, checkpointing, share in (
        ("full forward, activation checkpointing (default)", True, 0),
        ("full forward, no checkpointing", False, 0),
        ("shared prefix, no checkpointing", False, 32),
    ):
        model = load_model(str(path))
        model.train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        times = []
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            lp = token_logprobs(model, batch, share_prefix_min_tokens=share)
            lp.sum().backward()
            times.append(time.perf_counter() - t0)
        values[name] = lp.detach()
        rows[name] = statistics.median(times)
        del model
    base = rows["full forward, activation checkpointing (default)"]
    shared = values["shared prefix, no checkpointing"]
    diff = float((shared - values["full forward, no checkpointing"]).abs().max())
    table = Table(
        title=f"One group: G={args.group_size}, prompt {len(prompt)} tokens (shared), own tokens "
        f"{int(batch.lengths.float().mean()) - len(prompt)} mean; shared prefix found "
        f"{shared_prefix_length(batch)} tokens; {args.threads} threads; median of {args.repeats}"
    )
    for col in ("forward + backward", "seconds", "speed-up vs default"):
        table.add_column(col, justify="left" if col == "forward + backward" else "right")
    for name, seconds in rows.items():
        table.add_row(name, f"{seconds:.2f}", f"{base / seconds:.2f}x")
    console.print(table)
    console.print(f"max |log-prob difference| shared prefix vs full forward: {diff:.2e}")


if __name__ == "__main__":
    main()
