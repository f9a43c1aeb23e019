"""The data-parallel learner's weight push gathers one parameter at a time into the buckets
(issue 18, item 1): `torchrun` with 2 CPU ranks on gloo (tests/helpers/data_parallel_push.py)
stages a sharded model through the shm, distributed and disk transports, into new buckets and
then into the kept ones; the engines would read exactly the bytes of the world-size-1 push of
the same parameters, and rank 0 never holds more than one gathered parameter at a time.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.helpers.data_parallel_push import (
    BUCKET_BYTES,
    TRANSPORTS,
    change_weights,
    push_all,
    small_model,
    stagings,
)
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def world_size_1_pushes(tmp_path) -> dict:
    """The reference: the same parameters through today's path (an unsharded model)."""
    torch.set_num_threads(1)
    model = small_model()
    kept = stagings(tmp_path / "reference")
    try:
        first = push_all(model, kept, 1)
        change_weights(model)
        return {"first": first, "second": push_all(model, kept, 2)}
    finally:
        for staging in kept.values():
            staging.close()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_two_ranks_push_the_bytes_of_one_process_gathering_one_parameter_at_a_time(tmp_path):
    out = tmp_path / "pushes.pt"
    script = REPO / "tests" / "helpers" / "data_parallel_push.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_owned(
        [*TORCHRUN, str(script), str(out)], cwd=REPO, env=env, capture_output=True, timeout_s=120
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    two = torch.load(out, weights_only=False)
    one = world_size_1_pushes(tmp_path)

    sizes = [p.numel() * p.element_size() for p in small_model().parameters()]
    model_bytes, largest_parameter = sum(sizes), max(sizes)
    for push in ("first", "second"):  # into new buckets, then into the kept ones
        for transport in TRANSPORTS:
            got, want = two[push][transport], one[push][transport]
            if transport == "disk":
                got, want = got["read_back"], want["read_back"]
                assert got.keys() == want.keys()
                assert all(same_bytes(got[n], want[n]) for n in want), (push, transport)
            else:
                got, want = got["read_back"]["buckets"], want["read_back"]["buckets"]
                assert len(got) == len(want) > 2, (push, transport)
                for (layout, flat), (want_layout, want_flat) in zip(got, want):
                    assert layout == want_layout and same_bytes(flat, want_flat), (push, transport)

            # about one gathered parameter alive at a time (torch's collective sometimes drops
            # the previous one a moment after its consumer did), never the model
            peak = two[push][transport]["peak_bytes"]
            bucket = two[push][transport]["largest_bucket_bytes"]
            assert bucket == one[push][transport]["largest_bucket_bytes"] <= BUCKET_BYTES
            limit = (bucket or BUCKET_BYTES) + largest_parameter  # disk: no bucket
            assert largest_parameter <= peak <= limit < model_bytes / 5, (push, transport, peak)
    # gathering the whole model before bucketing (the push before streaming) holds all of it
    assert two["whole_model_first_peak_bytes"] == model_bytes
