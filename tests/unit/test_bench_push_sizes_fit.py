"""bench_push_sizes_cpu skips a variant this machine cannot hold instead of being OOM-killed (issue
37: `make bench` to its end): the old distributed push needs the whole model twice more in float32."""

from __future__ import annotations

from benchmarks.bench_push_sizes_cpu import unfit_reason


def test_only_the_old_distributed_push_past_available_memory_is_skipped():
    huge = 1 << 50  # float32 bytes no machine has twice over
    reason = unfit_reason("distributed", "old", huge)
    assert reason is not None and reason.startswith("skipped: needs ~") and "available" in reason
    assert unfit_reason("distributed", "old", 1 << 20) is None  # 2 MiB more fits anywhere
    assert unfit_reason("shm", "old", huge) is None  # the parameters live in the segment
    assert unfit_reason("distributed", "stream 128", huge) is None  # two bf16 slots, not the model
