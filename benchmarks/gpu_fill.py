"""Learner-side staging of a CUDA IPC bucket (issue 9): how the copies to the engine GPU are laid out.

`python -m benchmarks.gpu_fill [--shape qwen2.5-0.5b] [--src cuda:0] [--dst cuda:1]`: bf16 parameters
of the shape (random), timed from "step done" (synchronized) until both GPUs are synchronized again:
  flatten + one copy     torch._foreach_copy_ into a kept flat buffer on src, ONE copy to dst
  pipelined k            CudaIpcBucket(staging="bucket") with PIPELINE_CHUNKS = k (flatten of chunk
                         i+1 overlaps the link copy of chunk i)
  per-tensor             CudaIpcBucket(staging="direct"): one copy per tensor across the link
  sync=False             fill(sync=False): the time until it returns (copies enqueued) and to completion
  pipelined 8, thread    asyncio.to_thread(fill) (the thread hop WeightSync pays)
  floor                  one copy of the same bytes, already flat
Median / p90 over --repeats after 3 warm-ups. Skips without two CUDA devices.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def _summary(samples: list[float]) -> str:
    s = sorted(samples)
    return f"{1e3 * statistics.median(s):7.2f} {1e3 * s[int(0.9 * (len(s) - 1))]:7.2f}"


def main(argv: list[str] | None = None) -> None:
    import torch

    from benchmarks.model_shapes import random_model
    from shellrl.weights import bucket as wt
    from shellrl.weights import gpu as wtg

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--src", default="cuda:0")
    p.add_argument("--dst", default="cuda:1")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_fill: no CUDA, skipped")
        return
    src, dst = torch.device(args.src), torch.device(args.dst)
    model = random_model(args.shape, device=str(src), dtype=torch.bfloat16)
    named = [(n, q.detach()) for n, q in model.named_parameters()]
    meta, nbytes = wt.plan_bucket(named)

    def timed(fn) -> str:
        out = []
        for i in range(3 + args.repeats):
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            if i >= 3:
                out.append(time.perf_counter() - t0)
        return _summary(out)

    rows = []
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=src)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    rows.append(("floor: one copy, already flat", timed(lambda: flat_dst.copy_(flat_src))))
    views = wt._views(flat_src, meta)
    tensors = [t for _, t in named]

    def single():
        torch._foreach_copy_(views, tensors)
        flat_dst.copy_(flat_src)

    rows.append(("flatten + one copy", timed(single)))
    for k in (1, 2, 4, 8, 16, 32):
        wtg.PIPELINE_CHUNKS = k
        bucket = wtg.CudaIpcBucket(dst)
        rows.append((f"pipelined {k}", timed(lambda: bucket.fill(named))))
        bucket.close()
    wtg.PIPELINE_CHUNKS = 8
    bucket = wtg.CudaIpcBucket(dst)
    rows.append(
        ("per-tensor (staging=direct)", timed(lambda: bucket.fill(named, staging="direct")))
    )
    bucket.close()
    bucket = wtg.CudaIpcBucket(dst)
    returned = []

    def enqueue_only():
        t = time.perf_counter()
        bucket.fill(named, sync=False)
        returned.append(time.perf_counter() - t)

    rows.append(("pipelined 8, sync=False (to completion)", timed(enqueue_only)))
    rows.append(("  ... host time until fill returned", _summary(returned[3:])))
    bucket.close()
    bucket = wtg.CudaIpcBucket(dst)
    loop = asyncio.new_event_loop()
    rows.append(
        (
            "pipelined 8, asyncio.to_thread",
            timed(lambda: loop.run_until_complete(asyncio.to_thread(bucket.fill, named))),
        )
    )
    loop.close()
    bucket.close()
    print(f"{args.shape}: {len(named)} tensors, {nbytes / 1e9:.3f} GB, {src} -> {dst}")
    print(f"{'variant':36s}  median ms  p90 ms")
    for name, s in rows:
        print(f"{name:36s}  {s}")


if __name__ == "__main__":
    main()
