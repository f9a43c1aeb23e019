import os
import sys

import torch

from services.learner.weights.weight_transport import (
    choose_transport,
    remove_orphan_segments,
    split_buckets,
)
from tests.helpers.owned_processes import run_owned


def test_orphan_segments_of_dead_learners_are_removed_and_live_ones_kept(tmp_path):
    dead = run_owned(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout_s=120,
    )
    dead_pid = int(dead.stdout)
    (tmp_path / f"shellrl_w_{dead_pid}_abc123").write_bytes(b"x")
    (tmp_path / f"shellrl_w_{os.getpid()}_def456").write_bytes(b"x")
    (tmp_path / "other_segment").write_bytes(b"x")
    assert remove_orphan_segments(directory=tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"shellrl_w_{os.getpid()}_def456", "other_segment"]
    )


def test_transport_follows_the_topology():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_transport("auto", cpu, ["http://127.0.0.1:30000"]) == "shm"
    assert choose_transport("auto", gpu, ["http://localhost:30000"]) == "cuda_ipc"
    assert (
        choose_transport("auto", cpu, ["http://127.0.0.1:30000", "http://10.0.0.7:30000"]) == "disk"
    )
    assert choose_transport("disk", cpu, ["http://127.0.0.1:30000"]) == "disk"


def test_buckets_keep_order_and_respect_the_size_bound():
    named = [(f"t{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    buckets = split_buckets(named, bucket_bytes=2200)
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert len(split_buckets([("big", torch.zeros(10_000))], bucket_bytes=100)) == 1


async def test_a_call_that_timed_out_is_reported_as_the_deadline_and_a_refused_one_as_an_error(
    tmp_path,
):
    # The client's timeout is the deadline's length; the session opened during the flatten can time
    # out just before the deadline's timer. That is the deadline; a refused connection is an error.
    import asyncio

    from services.learner.weights.weight_sync import WeightSync
    from shellrl.clients.engine import EngineClient
    from shellrl.clients.engine_responses import EngineUnavailable

    sync = WeightSync(
        EngineClient(["http://e"]), None, transport="disk", deadline_s=2.0, sync_dir=tmp_path
    )

    def failing(exc):
        async def update(*_):  # FAKE update injecting the failure
            await asyncio.sleep(0.01)
            raise exc

        return update

    sync._update = failing(
        EngineUnavailable("http://e", "no answer in time (ReadTimeout)", timed_out=True)
    )
    ok, reason = await sync._update_within_deadline("http://e", {}, 1)
    assert not ok and reason.startswith("deadline: no confirmation within 2 s (")
    sync._update = failing(EngineUnavailable("http://e", "cannot connect"))
    ok, reason = await sync._update_within_deadline("http://e", {}, 1)
    assert not ok and reason == "EngineUnavailable: http://e: cannot connect"
    await sync.client.close()
