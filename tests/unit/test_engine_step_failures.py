"""A forward that raises ends only its own requests (services/engine/scheduler.py, `_guarded`,
`_guarded_prefill`), on the real scheduler and the tiny model on CPU. The fault is injected:
`FaultyFirstJoinSampling` raises CUDA's out-of-memory error once, when a prefilled request samples
its first token after joining a running batch (what an H100 engine at its memory cap did in issue
33's runs, BENCHMARKS.md: 107 of 108 evaluation episodes ended in OutOfMemoryError, one in
IndexError)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine import metrics, running_batch
from services.engine.prefix_cache import PrefixCache
from services.engine.protocol import RequestSpec
from services.engine.sampling import SamplingSpec
from services.engine.scheduler import Scheduler
from shellrl.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny", dtype=torch.float32)


class FaultyFirstJoinSampling:
    """Replaces RunningBatch.sample: raises torch.OutOfMemoryError the first time rows that
    joined a non-empty running batch sample (first_row > 0), then samples as the real one."""

    def __init__(self, real) -> None:
        self.real, self.raised = real, 0

    def __call__(self, batch, logits, first_row):
        if first_row > 0 and not self.raised:
            self.raised += 1
            raise torch.OutOfMemoryError("FAULT: CUDA out of memory (injected)")
        return self.real(batch, logits, first_row)


def spec(rid: str, first: int) -> RequestSpec:
    """40 prompt tokens of their own (no shared prefix), 24 greedy tokens."""
    return RequestSpec(
        rid=rid,
        input_ids=tuple(range(first, first + 40)),
        max_new_tokens=24,
        sampling=SamplingSpec(0.0),
        ignore_eos=True,
    )


def run(model, fault) -> tuple[dict, Scheduler]:
    """a0, a1, b0 submitted at once; a prefill budget of one prompt admits one a loop, so a1 and
    b0 each join a running batch. Returns rid -> finished state, and the scheduler."""
    scheduler = Scheduler(
        model,
        load_tokenizer("tiny"),
        weight_version="0",
        max_running_requests=8,
        max_prefill_tokens=48,
        prefix_cache=PrefixCache(64 << 20),
        eos_token_ids=set(),
        fp32_lm_head=True,
    )

    async def go() -> dict:
        scheduler.start()
        try:
            states = scheduler.submit_many(
                [spec("a0", 100), spec("a1", 300), spec("b0", 500)], asyncio.get_running_loop()
            )
            await asyncio.wait_for(asyncio.gather(*(s.future for s in states)), 120)
        finally:
            scheduler.stop()
        return {s.spec.rid: s for s in states}

    real = running_batch.RunningBatch.sample
    if fault is not None:
        running_batch.RunningBatch.sample = lambda b, logits, first: fault(b, logits, first)
    try:
        return asyncio.run(go()), scheduler
    finally:
        running_batch.RunningBatch.sample = real


def _failures(stage: str) -> float:
    return metrics.STEP_FAILURES.labels(stage, "OutOfMemoryError")._value.get()


def test_a_prefill_that_fails_after_joining_ends_only_its_own_requests(model):
    clean, _ = run(model, None)
    assert {rid: s.finish_reason["type"] for rid, s in clean.items()} == dict.fromkeys(
        clean, "length"
    )
    before = _failures("prefill")
    fault = FaultyFirstJoinSampling(running_batch.RunningBatch.sample)
    got, _ = run(model, fault)
    assert fault.raised == 1
    # the request whose first sampling failed ends with the engine's error ...
    assert got["a1"].finish_reason["type"] == "abort"
    assert "OutOfMemoryError" in got["a1"].finish_reason["message"]
    assert got["a1"].output_ids == []
    # ... and the others finish as in a run without the fault (before the fix: a0 and b0 ended
    # with "engine error: IndexError('list index out of range')" at the next decode step)
    for rid in ("a0", "b0"):
        assert got[rid].finish_reason == {"type": "length", "length": 24}, rid
        assert got[rid].output_ids == clean[rid].output_ids, rid
        torch.testing.assert_close(
            torch.tensor(got[rid].logprobs), torch.tensor(clean[rid].logprobs), atol=1e-4, rtol=0
        )
    assert _failures("prefill") == before + 1


def test_out_of_memory_empties_the_prefix_cache(model):
    """The prefix cache is the memory the engine holds by choice: after an OOM it is given up, so
    the next forward has it (the requests that follow then compute their prefixes again)."""
    fault = FaultyFirstJoinSampling(running_batch.RunningBatch.sample)
    got, scheduler = run(model, fault)
    assert fault.raised == 1
    # a0's prefill, before the fault, offered its prompt's KV; the OOM cleared the cache, and
    # a0's later offers carry the old generation, so they are ignored
    assert scheduler.prefix_cache.generation >= 2  # clear() at construction, then the OOM's
    assert scheduler.prefix_cache.match(list(range(100, 140)), 40)[0] == 0  # a0's prompt: gone
