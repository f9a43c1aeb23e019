"""Two gloo ranks under torchrun that end their processes right after their last collectives: the
teardown abort of issue 29 ("terminate called without an active exception", SIGABRT, exit -6).

    python tests/helpers/two_rank_exit.py --mode leave --repeat 20 --parallel 2
    python tests/helpers/two_rank_exit.py --mode destroy_only --repeat 40 --parallel 2

Each run is one `torchrun --standalone --nproc-per-node 2` of this file: both ranks join through
the learner's own `init_ranks`, run the follower's last exchange (`scatter_object_list` of
tensors, 20 times: the commands of data_parallel.follow, ending with STOP), then end:
* leave: `Ranks.close(together=True)`, then shellrl.process_groups.exit_process(0), as the
  learner's ranks and the two-rank test helpers do now;
* destroy_only: what `Ranks.close` did before (dist.destroy_process_group() with the group still
  referenced by the Ranks), then the interpreter's own exit.
Measured on 2 cores with other tests running (`--repeat 60 --parallel 2`): destroy_only aborted
8 runs in 60, leave 0 in 60; on a later day destroy_only aborted 3 in 328, only one run at a time
under heavy load (BENCHMARKS.md, "Rank teardown"). `runs(...)` is what
tests/service/test_process_groups.py calls; as a script without torchrun's environment it prints
one JSON line {"mode", "runs", "aborts", "returncodes"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script

EXCHANGES = 20
KEPT = None
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run_rank(mode: str) -> None:
    """One rank's whole life (this process, under torchrun)."""
    import torch
    import torch.distributed as dist

    from services.learner.ranks import init_ranks
    from shellrl.process_groups import exit_process

    ranks = init_ranks(fsdp="on", backend="gloo", device="cpu", timeout_s=60)
    for _ in range(EXCHANGES):
        out = [None]
        messages = [torch.ones(10_000), torch.ones(10_000)] if ranks.leader else None
        dist.scatter_object_list(out, messages, src=0, group=ranks.control)
    if mode == "leave":
        ranks.close(together=True)
        exit_process(0)
    global KEPT
    KEPT = ranks  # the Ranks (and its group) outlive the destroy, as they did in the learner
    dist.destroy_process_group()


def runs(mode: str, repeat: int, parallel: int = 2, timeout_s: float = 180.0) -> list[dict]:
    """{"returncode", "aborted"} of `repeat` torchrun runs, `parallel` in flight at any time (the
    next starts as soon as one ends; started with tests.helpers.owned_processes, so they die with
    the caller), in the order they ended. aborted: a rank died of SIGABRT (torchrun reports
    "exitcode: -6")."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tests.helpers.owned_processes import kill_group, popen_owned

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [*TORCHRUN, __file__, "--mode", mode]
    running: set = set()
    stopping = False

    def one() -> dict:
        if stopping:
            return {}
        proc = popen_owned(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        running.add(proc)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except BaseException:
            kill_group(proc)
            raise
        finally:
            running.discard(proc)
        text = output.decode(errors="replace")
        return {
            "returncode": proc.returncode,
            "aborted": "exitcode: -6" in text or "terminate called" in text,
            "tail": text[-2000:] if proc.returncode else "",
        }

    with ThreadPoolExecutor(parallel) as pool:
        futures = [pool.submit(one) for _ in range(repeat)]
        try:
            return [future.result() for future in as_completed(futures)]
        except BaseException:
            stopping = True  # a run that failed or timed out: start no more, end the others
            for future in futures:
                future.cancel()
            for proc in list(running):
                kill_group(proc)
            raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("leave", "destroy_only"), default="leave")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # a rank, started by torchrun
        run_rank(args.mode)
        return
    results = runs(args.mode, args.repeat, args.parallel)
    print(
        json.dumps(
            {
                "mode": args.mode,
                "runs": args.repeat,
                "aborts": sum(r["aborted"] for r in results),
                "returncodes": [r["returncode"] for r in results],
            }
        )
    )


if __name__ == "__main__":
    main()
