"""Data-parallel learner on CPU (issue 18): `python -m benchmarks.bench_data_parallel [--quick]`.

Learner tokens/s with 1 rank and with 2 ranks (`torchrun --nproc-per-node N`, gloo), one thread
each (OMP_NUM_THREADS=1, torch.set_num_threads(1)), on jemalloc as the learner runs. Each rank
is the learner's own code: rank 0 drives `DataParallel.step` (split by tokens, scatter, FSDP2
forward/backward with the gradient reduce-scatter, AdamW, merged result), the other follows.
Rows: 1 rank as the learner runs alone (no FSDP), 1 rank with FSDP2 on (a process group of one:
what sharding itself costs), 2 ranks with FSDP2. Also the gather of the full weights that a
weight push reads (`DataParallel.weights`).

SmolLM2-135M-Instruct in float32, `--steps` steps of `--trajectories` trajectories of ~`--tokens`
tokens after one warm-up step; micro-batch 4, gradient checkpointing (the learner's defaults).
`--quick`: the tiny test model, one step of 4 trajectories of ~64 tokens, the 1-rank and 2-rank rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIGS = (("1 rank, no FSDP (the default)", 1, "off"), ("1 rank, FSDP2", 1, "on"))
CONFIGS += (("2 ranks, FSDP2", 2, "auto"),)


def samples(trajectories: int, tokens: int, seed: int):
    import numpy as np

    from shellrl.rl.batch import TrainSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(trajectories):
        total = int(tokens + rng.integers(-tokens // 4, tokens // 4 + 1))
        p = total // 2
        r = total - p
        out.append(
            TrainSample(
                trajectory_id=f"t{seed}-{i}",
                prompt_ids=rng.integers(200, 40000, p),
                response_ids=rng.integers(200, 40000, r),
                behavior_logprobs=rng.normal(-3, 1, r).clip(max=0).astype(np.float32),
                loss_mask=np.ones(r, dtype=np.uint8),
                policy_versions=np.zeros(r, dtype=np.int64),
                temperatures=np.ones(r, dtype=np.float32),
                advantage=float(rng.normal()),
            )
        )
    return out


def timed(trainer, record: list) -> None:
    """Record (wall s, CPU s of this process) of every Trainer.step of this rank."""
    step = trainer.step

    def wrapper(*a, **kw):
        wall, cpu = time.perf_counter(), time.process_time()
        result = step(*a, **kw)
        record.append((time.perf_counter() - wall, time.process_time() - cpu))
        return result

    trainer.step = wrapper


def worker(args) -> None:
    """One rank (under torchrun): times its steps; the leader writes the step times to args.out,
    every rank its CPU seconds over the timed steps to args.out + ".rank<r>"."""
    import torch

    from services.learner.checkpoint import CheckpointStore
    from services.learner.data_parallel import DataParallel, follow
    from services.learner.ranks import init_ranks
    from services.learner.trainer import Trainer
    from services.learner.trainer_config import TrainerConfig
    from shellrl.models import load_model
    from shellrl.process_groups import exit_process

    torch.set_num_threads(1)
    ranks = init_ranks(fsdp=args.fsdp, backend="gloo", device="cpu", timeout_s=1800)
    torch.manual_seed(0)
    trainer = Trainer(load_model(args.model), TrainerConfig(lr=1e-6, micro_batch_size=4), ranks)
    store = CheckpointStore(args.scratch)
    record: list = []
    timed(trainer, record)
    rows, gather_s = [], 0.0
    if ranks.leader:
        dp = DataParallel(trainer, store, pad_token_id=0)
        for step in range(args.steps + 1):  # step 0 warms up
            batch = samples(args.trajectories, args.tokens, seed=step)
            start = time.perf_counter()
            result = dp.step(batch, step)
            tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch)
            rows.append({"seconds": time.perf_counter() - start, "tokens": tokens})
            rows[-1]["loss_tokens"] = result.tokens
        start = time.perf_counter()
        for _ in dp.weights.named_parameters():
            pass
        gather_s = time.perf_counter() - start
        dp.stop()  # the followers return and every rank leaves the group together
        Path(args.out).write_text(json.dumps({"steps": rows[1:], "gather_s": gather_s}))
    else:
        follow(trainer, store)
        ranks.close(together=True)
    cpu = sum(c for _, c in record[1:])
    Path(f"{args.out}.rank{ranks.rank}").write_text(json.dumps({"cpu": cpu}))
    exit_process(0)  # a rank never meets the interpreter's finalization (shellrl.process_groups)


def run_config(nproc: int, fsdp: str, args) -> dict:
    """One torchrun of `nproc` ranks: the leader's step times, its gather time, and every rank's
    CPU seconds over the timed steps ("cpu": one entry per rank)."""
    from services.learner.allocator import jemalloc_path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if jemalloc_path():
        env["LD_PRELOAD"] = jemalloc_path()
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(nproc), __file__, "--worker", "--fsdp", fsdp]
        command += ["--out", str(out), "--scratch", scratch, "--model", args.model]
        command += ["--steps", str(args.steps), "--trajectories", str(args.trajectories)]
        command += ["--tokens", str(args.tokens)]
        subprocess.run(command, cwd=REPO, env=env, check=True)
        result = json.loads(out.read_text())
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(nproc)]
    result["cpu"] = [r["cpu"] for r in ranks]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_data_parallel")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 1 step of 4 short trajectories, 1 rank and 2 ranks (a smoke run)",
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return
    configs = CONFIGS
    if args.quick:
        args.model, args.tokens, args.steps, args.trajectories = "tiny", 64, 1, 4
        configs = (CONFIGS[0], CONFIGS[-1])

    from rich.console import Console
    from rich.table import Table

    title = f"Learner tokens/s on CPU, one thread per rank ({args.model})"
    table = Table(title=title + f"; load average before: {os.getloadavg()[0]:.1f}")
    columns = ("ranks", "step s", "tokens/s", "vs 1 rank", "CPU s/step (per rank)")
    for column in (*columns, "vs 1 rank, CPU", "gather s"):
        table.add_column(column, justify="left" if column == "ranks" else "right")
    base = base_cpu = None
    for name, nproc, fsdp in configs:
        result = run_config(nproc, fsdp, args)
        steps = result["steps"]
        total_s = sum(r["seconds"] for r in steps)
        rate = sum(r["tokens"] for r in steps) / total_s
        cpu = [c / len(steps) for c in result["cpu"]]  # per step, per rank
        base, base_cpu = base or rate, base_cpu or max(cpu)
        table.add_row(
            name,
            f"{statistics.median(r['seconds'] for r in steps):.1f}",
            f"{rate:.1f}",
            f"{rate / base:.2f}x",
            " / ".join(f"{c:.1f}" for c in cpu),
            f"{base_cpu / max(cpu):.2f}x",  # the speed-up if each rank had a free core
            f"{result['gather_s']:.2f}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
