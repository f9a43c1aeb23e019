"""The engine's WeightStore: double-buffered arenas, atomic commit, tied parameters."""

from __future__ import annotations

import torch

from services.engine.weights import WeightStore
from shellrl.weights import bucket as wt
from shellrl.weights import shm


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's lm_head


def _named(model, shift: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach() + shift) for n, p in model.named_parameters()]


def test_updates_alternate_between_two_reused_arenas_and_commit_swaps_without_copying():
    model, source = Tied(), Tied()
    store = WeightStore(model)
    pointers = []
    for step in range(4):
        buffer, metadata = wt.flatten_tensors(_named(source, step))
        staged = store.stage_bucket(buffer, metadata)
        before = model.mid.weight.detach().clone()
        buffer.zero_()  # the sender may reuse its buffer once staging returned
        assert torch.equal(model.mid.weight, before), "staging must not touch live weights"
        store.commit(staged)
        assert torch.equal(model.mid.weight, source.mid.weight + step)
        assert (
            model.mid.weight.untyped_storage().data_ptr()
            == staged.tensors["mid.weight"].untyped_storage().data_ptr()
        )
        pointers.append(model.mid.weight.untyped_storage().data_ptr())
    assert pointers[0] == pointers[2] and pointers[1] == pointers[3] and pointers[0] != pointers[1]


def test_tied_parameter_sent_under_both_names_stays_tied():
    model, source = Tied(), Tied()
    store = WeightStore(model)
    named = [(n, p.detach() + 1) for n, p in source.named_parameters(remove_duplicate=False)]
    for _ in range(3):
        store.commit(store.stage(named))
        assert model.head.weight is model.embed.weight
        assert torch.equal(model.head.weight, source.embed.weight + 1)


def test_partial_buckets_of_one_session_only_replace_their_parameters():
    model, source = Tied(), Tied()
    store = WeightStore(model)
    old_mid = model.mid.weight.detach().clone()
    named = _named(source, 5)
    first = store.stage_bucket(*wt.flatten_tensors(named[:1]))
    first.merge(store.stage_bucket(*wt.flatten_tensors(named[2:])))
    store.commit(first)
    assert torch.equal(model.embed.weight, source.embed.weight + 5)
    assert torch.equal(model.mid.weight, old_mid)
    assert torch.equal(model.mid.bias, source.mid.bias + 5)


def test_a_refilled_shared_memory_segment_is_mapped_once_and_a_new_segment_replaces_the_mapping():
    model, source = Tied(), Tied()
    store = WeightStore(model)
    with shm.SharedMemoryBucket(_named(source, 0.0)) as kept:
        store.commit(store.stage_serialized([kept.payload()], wt.LOAD_FORMAT))
        mapping = store._shm_mapping
        for step in (1.0, 2.0):
            kept.refill(_named(source, step))  # same segment, new bytes
            store.commit(store.stage_serialized([kept.payload()], wt.LOAD_FORMAT))
            assert store._shm_mapping is mapping  # not mapped again
            assert torch.equal(
                model.mid.weight, source.mid.weight + step
            )  # ... and the new bytes are read
        with shm.SharedMemoryBucket(_named(source, 5.0)) as other:  # another segment: a new mapping
            store.commit(store.stage_serialized([other.payload()], wt.LOAD_FORMAT))
            assert store._shm_mapping is not mapping and torch.equal(
                model.mid.weight, source.mid.weight + 5.0
            )
