"""Learner benchmarks (issue 7): `python -m benchmarks.bench_learner [--quick] [--threads N] [--glibc]`.

Runs on jemalloc, as `python -m services.learner` does (services/learner/allocator.py).

SmolLM2-135M-Instruct in float32 on CPU, the learner's own code (shellrl.rl, services.learner):

1. Step time for B trajectories of ~L tokens (half prompt, half response, loss mask on the
   response), split into: log-prob recompute (no-grad, float32 per sequence: what a separate
   proximal pass costs), forward/backward + AdamW (Trainer.step, micro-batch 4, gradient
   checkpointing), and the weight push to a running `python -m services.engine` (WeightSync,
   shared memory, until the engine reports the new version).
2. Peak memory of one forward+backward over the same batch with float32 log-probs computed one
   sequence at a time (shellrl.rl.logprobs) against the whole-batch float32 baseline
   (log_softmax over [B, L, V]), each in a fresh process: peak RSS (VmHWM reset before the pass)
   above the RSS after loading, on jemalloc as the learner runs (--glibc adds a glibc row), and
   the peak of live tensor bytes from the profiler (allocator-independent). Target: <= 0.5x.
3. Weight push end to end (median of --repeats): shared-memory bucket against the disk
   (safetensors) transport as the baseline. Target: <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from services.learner.allocator import jemalloc_path, reexec_with_jemalloc

console = Console()


def make_batch(trajectories: int, tokens: int, seed: int = 0):
    import numpy as np

    from shellrl.rl.batch import TrainSample, build_batch

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(trajectories):
        total = int(tokens + rng.integers(-16, 17))
        p = total // 2
        r = total - p
        samples.append(
            TrainSample(
                trajectory_id=f"t{i}",
                prompt_ids=rng.integers(200, 40000, p),
                response_ids=rng.integers(200, 40000, r),
                behavior_logprobs=np.full(r, -8.0, np.float32),
                loss_mask=np.ones(r, np.uint8),
                policy_versions=np.zeros(r, np.int64),
                temperatures=np.ones(r, np.float32),
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return build_batch(samples, pad_token_id=2)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _memory_child(
    mode: str,
    trajectories: int,
    tokens: int,
    threads: int,
    out,
    model_path: str,
    profile_tensors: bool,
) -> None:
    """One forward+backward in a fresh process. Sends (peak RSS above the RSS before the pass, peak
    bytes of live tensors during the pass or 0 when not profiled, seconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from shellrl.models import load_model
    from shellrl.rl.logprobs import enable_gradient_checkpointing, token_logprobs

    torch.set_num_threads(threads)
    model = load_model(model_path, dtype=torch.float32)
    enable_gradient_checkpointing(model)
    model.train()
    batch = make_batch(trajectories, tokens)
    with (
        torch.no_grad()
    ):  # touch every weight once (safetensors may be mapped lazily), warm the allocator
        model(input_ids=batch.input_ids[:1, :8])
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    base_kb = _status_kb("VmRSS")

    def one_pass() -> None:
        if mode == "per_sequence":
            logp = token_logprobs(model, batch)
        else:  # whole batch: [B, L-1, V] float32 logits, log_softmax, gather
            hidden = model.get_decoder()(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
            ).last_hidden_state[:, :-1]
            logits = model.get_output_embeddings()(hidden).float()  # temperatures are 1 here
            logp = (
                torch.log_softmax(logits, -1).gather(-1, batch.target_ids.unsqueeze(-1)).squeeze(-1)
            )
            logp = logp * batch.loss_mask
        (-(logp * batch.advantages).sum() / batch.loss_mask.sum()).backward()

    start = time.perf_counter()
    peak = 0
    if profile_tensors:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            one_pass()
        events = sorted(
            (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
            key=lambda e: e.start_ns(),
        )
        live = 0
        for e in events:  # +bytes on allocation, -bytes on free: the peak of live tensor memory
            live += e.nbytes()
            peak = max(peak, live)
    else:
        one_pass()
    seconds = time.perf_counter() - start
    out.send(((_status_kb("VmHWM") - base_kb) * 1024, peak, seconds))


def measure_memory(
    mode: str,
    trajectories: int,
    tokens: int,
    threads: int,
    *,
    model_path: str = "smollm2",
    profile_tensors: bool = False,
    jemalloc: bool = True,
) -> tuple[int, int, float]:
    """(peak RSS bytes, peak tensor bytes, seconds) of one pass in a fresh process, on jemalloc (as
    the learner runs) or glibc malloc."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_memory_child,
        args=(mode, trajectories, tokens, threads, child, model_path, profile_tensors),
    )
    saved = os.environ.get("LD_PRELOAD")
    library = jemalloc_path()
    if jemalloc and library:
        os.environ["LD_PRELOAD"] = library
    else:
        os.environ.pop("LD_PRELOAD", None)
    try:
        proc.start()
    finally:
        os.environ.pop("LD_PRELOAD", None)
        if saved is not None:
            os.environ["LD_PRELOAD"] = saved
    while not parent.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(
                f"the {mode} memory measurement died with exit code {proc.exitcode} "
                "(out of memory?)"
            )
    result = parent.recv()
    proc.join()
    return result


class _Sent:
    """The `out` of `_memory_child` when it runs in this process."""

    def send(self, value) -> None:
        self.value = value


def measure_here(
    mode: str, trajectories: int, tokens: int, threads: int, model_path: str
) -> tuple[int, int, float]:
    """`measure_memory` with the profiler, in this process (a quick run: no process to start; the
    RSS peak is not isolated from what this process allocated before)."""
    sent = _Sent()
    _memory_child(mode, trajectories, tokens, threads, sent, model_path, True)
    return sent.value


async def bench_step_and_push(
    trajectories: int,
    tokens: int,
    threads: int,
    repeats: int,
    log_dir: Path,
    model_path: str = "smollm2",
):
    import torch

    from services.learner.trainer import Trainer
    from services.learner.trainer_config import TrainerConfig
    from services.learner.weights.weight_sync import WeightSync
    from shellrl.clients.engine import EngineClient
    from shellrl.models import load_model
    from tests.helpers.processes import ServiceProcess
    from tests.helpers.redis_server import free_port

    torch.set_num_threads(threads)
    env = {
        "SHELLRL_MODEL_PATH": model_path,
        "SHELLRL_LOG_LEVEL": "WARNING",
        "SHELLRL_NUM_THREADS": str(threads),
    }
    engine = ServiceProcess("engine", free_port(), env, log_dir).start(ready_timeout_s=300)
    try:
        model = load_model(model_path, dtype=torch.float32)
        trainer = Trainer(model, TrainerConfig(micro_batch_size=4))
        batch = make_batch(trajectories, tokens)
        t0 = time.perf_counter()
        trainer.logprobs(batch)
        recompute = time.perf_counter() - t0
        result = trainer.step(batch, learner_version=0)
        async with EngineClient([engine.url], timeout_s=120) as client:
            pushes = {}
            for transport in ("shm", "disk"):
                sync = WeightSync(
                    client, None, transport=transport, deadline_s=120, sync_dir=log_dir / "sync"
                )
                runs = []
                for i in range(repeats):
                    r = await sync.push(model, 1 + i + (100 if transport == "disk" else 0))
                    assert r.confirmed == (engine.url,), r.failed
                    runs.append(r.phases)
                sync.close()
                pushes[transport] = {k: statistics.median(p[k] for p in runs) for k in runs[0]}
        return recompute, result, pushes, batch.num_loss_tokens
    finally:
        engine.stop()


def memory_cells(
    name: str, rss: int, tensors: int, seconds: float, base_rss: int, base_tensors: int
) -> list[str]:
    """One row of the peak-memory table (bytes in, MiB and ratios out): "-" where the profiler
    recorded no tensor memory, for this row or for the baseline it is compared with."""
    return [
        name,
        f"{rss / 2**20:.0f}",
        f"{rss / base_rss:.2f}x" if base_rss else "-",
        f"{tensors / 2**20:.0f}" if tensors else "-",
        f"{tensors / base_tensors:.2f}x" if tensors and base_tensors else "-",
        f"{seconds:.1f}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_learner", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model, 2 trajectories of ~64 tokens, 1 push repeat, memory measured "
        "in this process (a smoke run)",
    )
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a HF directory")
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--glibc", action="store_true", help="also measure per-sequence RSS on glibc malloc"
    )
    args = parser.parse_args(argv)
    reexec_with_jemalloc("benchmarks.bench_learner", list(sys.argv[1:] if argv is None else argv))
    if args.quick:
        args.model, args.trajectories, args.tokens, args.repeats = "tiny", 2, 64, 1
    b, n = args.trajectories, args.tokens
    with tempfile.TemporaryDirectory(prefix="bench_learner_") as tmp:
        recompute, result, pushes, loss_tokens = asyncio.run(
            bench_step_and_push(b, n, args.threads, args.repeats, Path(tmp), args.model)
        )
    fwd_bwd, push = result.duration_s, pushes["shm"]["total"]
    total = recompute + fwd_bwd + push
    table = Table(
        title=f"Learner step, {args.model} float32, {b} trajectories x ~{n} tokens "
        f"({loss_tokens} loss tokens), {args.threads} threads"
    )
    for column in ("phase", "seconds", "share of step"):
        table.add_column(column, justify="right")
    for name, seconds in (
        ("log-prob recompute (no grad, per-sequence fp32)", recompute),
        ("forward/backward + AdamW (micro-batch 4)", fwd_bwd),
        ("weight push (shm, engine confirms)", push),
        ("total", total),
    ):
        table.add_row(name, f"{seconds:.2f}", f"{seconds / total:.0%}")
    console.print(table)

    rows = [
        ("whole-batch float32 [B, L, V] (baseline)", "whole_batch", True),
        ("per-sequence float32 (shellrl.rl.logprobs)", "per_sequence", True),
    ]
    if args.glibc:
        rows.append(("per-sequence float32, glibc malloc", "per_sequence", False))
    results = []
    for name, mode, jemalloc in rows:
        if args.quick:  # a smoke run: in this process (RSS not isolated), profiled once
            rss, tensors, seconds = measure_here(mode, b, n, args.threads, args.model)
        else:
            measure = functools.partial(
                measure_memory, mode, b, n, args.threads, model_path=args.model, jemalloc=jemalloc
            )
            rss, _, seconds = measure()
            tensors = measure(profile_tensors=True)[1] if jemalloc else 0
        results.append((name, rss, tensors, seconds))
    base_rss, base_tensors = results[0][1] or 1, results[0][2]
    where = (
        "quick: in this process, RSS not isolated"
        if args.quick
        else "jemalloc, as the learner runs"
    )
    table = Table(
        title=f"Peak memory of one forward+backward over {b} x ~{n} tokens above the loaded model: "
        f"RSS (VmHWM; {where}) and live tensors (profiler)"
    )
    for column in (
        "log-probs",
        "peak RSS MiB",
        "vs whole batch",
        "peak tensors MiB",
        "vs whole batch",
        "seconds",
    ):
        table.add_column(column, justify="right")
    for name, rss, tensors, seconds in results:
        table.add_row(*memory_cells(name, rss, tensors, seconds, base_rss, base_tensors))
    console.print(table)

    table = Table(
        title=f"Weight push end to end to a running engine, median of {args.repeats} (seconds)"
    )
    phases = ["flatten", "transfer", "load", "verify", "total"]
    for column in ("transport", *phases, "vs disk"):
        table.add_column(column, justify="right")
    for transport in ("disk", "shm"):
        p = pushes[transport]
        ratio = p["total"] / pushes["disk"]["total"]
        table.add_row(
            transport + (" (baseline)" if transport == "disk" else ""),
            *[f"{p.get(k, 0.0):.3f}" for k in phases],
            f"{ratio:.2f}x",
        )
    console.print(table)


if __name__ == "__main__":
    main()
