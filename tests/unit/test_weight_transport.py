"""Flattened-bucket layout and the shared-memory / disk transports (CUDA IPC is in tests/gpu)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from shellrl.weights import bucket as wt
from shellrl.weights import disk as wtd
from shellrl.weights import shm
from tests.helpers.owned_processes import run_owned


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("w.float", torch.randn(3, 5, generator=g)),
        ("w.int", torch.arange(7, dtype=torch.int64)),
        ("w.bf16", torch.randn(5, generator=g).bfloat16()),
        ("w.half", torch.randn(2, 3, generator=g).half()),
    ]


def test_flatten_then_unflatten_returns_identical_tensors_with_byte_offsets():
    tensors = _tensors()
    buffer, metadata = wt.flatten_tensors(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    for meta, (name, tensor) in zip(metadata, tensors):
        assert meta.name == name and meta.numel == tensor.numel() * tensor.element_size()
        assert meta.end_idx == meta.start_idx + meta.numel and meta.start_idx % wt.ALIGN_BYTES == 0
    for (name, original), (name2, restored) in zip(tensors, wt.unflatten_tensors(buffer, metadata)):
        assert (
            name == name2 and restored.dtype == original.dtype and torch.equal(restored, original)
        )


def test_metadata_from_json_rejects_a_byte_range_that_does_not_fit_the_shape():
    good = {
        "name": "x",
        "dtype": "float32",
        "shape": [2, 3],
        "start_idx": 0,
        "end_idx": 24,
        "numel": 24,
    }
    assert wt.TensorMeta.from_json(good).shape == (2, 3)
    with pytest.raises(ValueError, match="does not hold"):
        wt.TensorMeta.from_json(good | {"shape": [2, 4]})
    with pytest.raises(ValueError, match="unsupported dtype"):
        wt.TensorMeta.from_json(good | {"dtype": "object"})


def test_unflatten_rejects_an_entry_outside_the_buffer():
    meta = wt.TensorMeta("x", "float32", (4,), 0, 16, 16)
    with pytest.raises(ValueError, match="exceed"):
        wt.unflatten_tensors(torch.zeros(8, dtype=torch.uint8), [meta])


def test_shared_memory_bucket_is_read_by_another_process_and_unlinked_on_close(tmp_path):
    tensors = _tensors()
    reader = (
        "import json, sys, torch\n"
        "from shellrl.weights import shm\n"
        "payload = json.loads(sys.stdin.read())\n"
        "with shm.open_shared_memory_bucket(payload) as views:\n"
        "    torch.save({n: t.clone() for n, t in views}, sys.argv[1])\n"
    )
    with shm.SharedMemoryBucket(tensors) as bucket:
        payload = json.loads(bucket.payload())
        assert payload["transport"] == "shm" and os.path.exists(f"/dev/shm/{bucket.name}")
        run_owned(
            [sys.executable, "-c", reader, str(tmp_path / "out.pt")],
            input=bucket.payload(),
            text=True,
            check=True,
            timeout_s=60,
        )
        assert os.path.exists(f"/dev/shm/{bucket.name}"), (
            "the reader must not unlink the learner's segment"
        )
    assert not os.path.exists(f"/dev/shm/{bucket.name}")
    received = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(received[name], tensor) for name, tensor in tensors)


def test_opening_a_missing_segment_raises_file_not_found():
    with pytest.raises(FileNotFoundError):
        with shm.open_shared_memory_bucket({"segment": "shellrl_w_missing_0", "metadata": []}):
            pass
    with pytest.raises(ValueError, match="segment name"):
        with shm.open_shared_memory_bucket({"segment": "../etc/passwd", "metadata": []}):
            pass


def test_safetensors_dir_round_trip(tmp_path):
    tensors = _tensors()
    wtd.save_safetensors_dir(tensors, tmp_path / "ckpt")
    loaded = dict(wtd.load_safetensors_dir(tmp_path / "ckpt"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors)
    with pytest.raises(FileNotFoundError):
        wtd.load_safetensors_dir(tmp_path)


def test_shared_memory_bucket_refill_reuses_the_segment():
    tensors = _tensors()
    with shm.SharedMemoryBucket(tensors) as bucket:
        name = bucket.name
        changed = [(n, t + 1) for n, t in tensors]
        payload = json.loads(bucket.refill(changed).payload())
        assert payload["segment"] == name
        with shm.open_shared_memory_bucket(payload) as views:
            assert all(torch.equal(v, t) for (_, v), (_, t) in zip(views, changed))
        with pytest.raises(ValueError, match="do not fit"):
            bucket.refill(tensors + [("big", torch.zeros(1000))])


def test_adopted_parameters_live_in_the_segment_and_a_refill_copies_nothing(tmp_path):
    """SharedMemoryBucket.adopt: the optimizer's in-place writes are what the engine reads; a refill
    with the same parameters writes nothing; close() moves them back out, values intact; a model
    whose parameters share the segment still saves and reloads as a HF checkpoint."""
    from shellrl.models import load_model

    model = load_model("tiny")
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    before = {n: t.clone() for n, t in named}
    bucket = shm.SharedMemoryBucket(named)
    try:
        bucket.adopt([p for _, p in model.named_parameters()])
        assert bucket.adopted
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0)  # an "optimizer step", in place
        refilled = bucket.refill([(n, p.detach()) for n, p in model.named_parameters()])
        assert refilled is bucket and bucket.adopted  # nothing copied: the same storage
        with shm.open_shared_memory_bucket(json.loads(bucket.payload())) as seen:
            for name, tensor in seen:
                assert torch.equal(tensor, before[name] * 2.0), name
        model.save_pretrained(
            tmp_path / "ckpt", safe_serialization=True
        )  # params share one storage
        reloaded = load_model(str(tmp_path / "ckpt"))
        for (name, p), (_, q) in zip(model.named_parameters(), reloaded.named_parameters()):
            assert torch.equal(p, q), name
    finally:
        bucket.close()
    assert not (Path("/dev/shm") / bucket.name).exists()
    for name, p in model.named_parameters():  # moved out of the unmapped segment, values kept
        assert torch.equal(p.detach(), before[name] * 2.0), name
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # private memory again: writable after close


def test_adopt_refuses_parameters_that_do_not_match_their_slots():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    with shm.SharedMemoryBucket([("a", a.detach()), ("b", b.detach())]) as bucket:
        with pytest.raises(ValueError, match="does not match"):
            bucket.adopt([b, a])
        with pytest.raises(ValueError, match="1 parameters for 2 slots"):
            bucket.adopt([a])
