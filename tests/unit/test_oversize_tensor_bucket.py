"""A bucket budget smaller than the largest tensor (issue 30, bad input): the tensor goes in a
bucket of its own, said once in the log (its name, its bytes, the budget); a streamed push grows
one slot for it, stays within two buckets plus the largest tensor, sends its bytes exactly, and
shrinks the slot back to the budget once the push is over."""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from services.learner.weights.weight_transport import WeightStaging, split_buckets
from shellrl.weights import distributed as wdist

BUDGET = 1000  # bytes
SAID = "a tensor larger than the bucket budget goes in a bucket of its own"


class Model(torch.nn.Module):
    """Four float32 tensors: 400 B, `big` (4,000 B: four times the budget), 400 B, 400 B. The big
    one's name is new to this process (split_buckets says a tensor once per process)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = f"over_budget_{uuid.uuid4().hex}"
        self.a = torch.nn.Parameter(torch.randn(100))
        self.register_parameter(self.big, torch.nn.Parameter(torch.randn(1000)))
        self.b = torch.nn.Parameter(torch.randn(100))
        self.c = torch.nn.Parameter(torch.randn(100))


def said(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == SAID and r.tensor == name]


def test_a_tensor_over_the_budget_goes_alone_said_once_in_the_log(caplog):
    model = Model()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    caplog.set_level(logging.WARNING, logger="services.learner.weights.weight_transport")
    buckets = split_buckets(named, BUDGET)
    assert [[n for n, _ in b] for b in buckets] == [["a"], [model.big], ["b", "c"]]
    records = said(caplog, model.big)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert (records[0].bytes, records[0].bucket_bytes) == (4000, BUDGET)
    # in bfloat16 it still does not fit (2,000 B): alone again, not said a second time
    halves = split_buckets(named, BUDGET, torch.bfloat16)
    assert [[n for n, _ in b] for b in halves] == [["a"], [model.big], ["b", "c"]]
    assert len(said(caplog, model.big)) == 1
    assert [r.tensor for r in caplog.records if r.getMessage() == SAID] == [model.big]


def test_a_streamed_push_grows_one_slot_for_it_and_shrinks_it_back(tmp_path):
    model = Model()
    staging = WeightStaging("distributed", tmp_path, bucket_bytes=BUDGET)
    largest = 4000

    async def push() -> dict[str, torch.Tensor]:
        prepared = staging.prepare(model, 1, ["e"])
        stream, received = prepared["stream"], {}
        for i, provider in enumerate(prepared["broadcast"]):
            fields, flat = await provider(1)
            metadata, nbytes = wdist.bucket_layout(**fields)
            for meta in metadata:
                received[meta.name] = flat[meta.start_idx : meta.end_idx].view(torch.float32)
            received = {k: v.clone() for k, v in received.items()}  # the slot is refilled
            stream.answered("e", i)
        stream.leave("e")
        assert stream.filled_at_once <= 2
        assert largest < stream.peak_resident_bytes <= 2 * BUDGET + largest
        staging.end_push()
        return received

    try:
        assert staging.streams(model) and staging.bucket_count(model) == 3
        received = asyncio.run(push())
        for name, p in model.named_parameters():
            assert torch.equal(received[name], p.detach()), name
        assert staging.resident_bytes <= 2 * BUDGET  # the grown slot is back to the budget
    finally:
        staging.close()
