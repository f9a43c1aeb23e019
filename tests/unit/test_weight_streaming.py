"""Streamed bucket fills (the sharded learner's push: one gathered tensor at a time): the same
bytes as filling from the tensors at hand, for the shm envelope bucket, the broadcast bucket and
the safetensors file; each tensor dropped before the next is made; mismatches named."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file

from shellrl.weights import bucket as wt
from shellrl.weights import disk as wtd
from shellrl.weights.distributed import FlatBucket
from shellrl.weights.sglang import SharedTensorBucket


def mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.weight", torch.randn(2, 3, generator=g).to(torch.float16)),
        ("d.count", torch.arange(5, dtype=torch.int64)),
        ("e.empty", torch.zeros(0, 4)),
    ]


def made_on_demand(tensors, alive: list):
    """(name, a fresh copy) per tensor, as a gather makes them; `alive` counts, at each one
    made, the earlier copies still referenced."""
    refs = []
    for name, tensor in tensors:
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
        copy = tensor.clone()
        refs.append(weakref.ref(copy))
        yield name, copy
        del copy


def test_a_streamed_fill_holds_the_bytes_of_a_fill_from_the_tensors_one_tensor_alive_at_a_time():
    tensors = mixed()
    for make in (SharedTensorBucket, lambda named, values=None: FlatBucket(named, "cpu", values)):
        want = make(tensors)
        alive: list = []
        got = make(wt.describe(tensors), made_on_demand(tensors, alive))
        assert got.metadata == want.metadata and got.nbytes == want.nbytes
        assert torch.equal(got._buffer(got.nbytes), want._buffer(want.nbytes))
        assert alive == [0] * len(tensors)
        changed = [(n, t + 1 if t.dtype != torch.int64 else t * 2) for n, t in tensors]
        assert got.fits(wt.describe(changed))
        got.refill(wt.describe(changed), iter(changed))  # the kept bucket, refilled
        want.refill(changed)
        assert torch.equal(got._buffer(got.nbytes), want._buffer(want.nbytes))
        got.close()
        want.close()


def test_a_streamed_fill_names_a_tensor_that_does_not_match_its_slot_or_is_missing():
    tensors = mixed()
    swapped = [tensors[1], tensors[0], *tensors[2:]]
    with pytest.raises(ValueError, match=r"b.bias bfloat16\[7\] does not match slot a.weight"):
        FlatBucket(wt.describe(tensors), "cpu", iter(swapped))
    with pytest.raises(ValueError, match="no tensor left for slot 'e.empty'"):
        FlatBucket(wt.describe(tensors), "cpu", iter(tensors[:-1]))


def test_a_streamed_safetensors_file_reads_back_as_the_file_of_the_tensors_at_hand(tmp_path):
    tensors = mixed()
    wtd.save_safetensors_dir(tensors, tmp_path / "whole")
    alive: list = []
    path = wtd.save_safetensors_stream(
        wt.describe(tensors), made_on_demand(tensors, alive), tmp_path / "streamed"
    )
    want, got = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(path))
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert alive == [0] * len(tensors)
    assert dict(wtd.load_safetensors_dir(tmp_path / "streamed")).keys() == want.keys()


def test_a_streamed_safetensors_file_that_fails_leaves_nothing_behind(tmp_path):
    tensors = mixed()
    with pytest.raises(ValueError, match="no tensor left for 'e.empty'"):
        wtd.save_safetensors_stream(wt.describe(tensors), iter(tensors[:-1]), tmp_path)
    assert list(tmp_path.iterdir()) == []
