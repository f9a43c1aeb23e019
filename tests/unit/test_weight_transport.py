"""Flattened-bucket layout and the shared-memory / disk transports (CUDA IPC is in tests/gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shellrl import weight_transport as wt


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("w.float", torch.randn(3, 5, generator=g)), ("w.int", torch.arange(7, dtype=torch.int64)),
            ("w.bf16", torch.randn(5, generator=g).bfloat16()), ("w.half", torch.randn(2, 3, generator=g).half())]


def test_flatten_then_unflatten_returns_identical_tensors_with_byte_offsets():
    tensors = _tensors()
    buffer, metadata = wt.flatten_tensors(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    for meta, (name, tensor) in zip(metadata, tensors):
        assert meta.name == name and meta.numel == tensor.numel() * tensor.element_size()
        assert meta.end_idx == meta.start_idx + meta.numel and meta.start_idx % wt.ALIGN_BYTES == 0
    for (name, original), (name2, restored) in zip(tensors, wt.unflatten_tensors(buffer, metadata)):
        assert name == name2 and restored.dtype == original.dtype and torch.equal(restored, original)


def test_metadata_from_json_rejects_a_byte_range_that_does_not_fit_the_shape():
    good = {"name": "x", "dtype": "float32", "shape": [2, 3], "start_idx": 0, "end_idx": 24, "numel": 24}
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
        "from shellrl import weight_transport as wt\n"
        "payload = json.loads(sys.stdin.read())\n"
        "with wt.open_shared_memory_bucket(payload) as views:\n"
        "    torch.save({n: t.clone() for n, t in views}, sys.argv[1])\n"
    )
    with wt.SharedMemoryBucket(tensors) as bucket:
        payload = json.loads(bucket.payload())
        assert payload["transport"] == "shm" and os.path.exists(f"/dev/shm/{bucket.name}")
        subprocess.run([sys.executable, "-c", reader, str(tmp_path / "out.pt")], input=bucket.payload(),
                       text=True, check=True, timeout=60)
        assert os.path.exists(f"/dev/shm/{bucket.name}"), "the reader must not unlink the learner's segment"
    assert not os.path.exists(f"/dev/shm/{bucket.name}")
    received = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(received[name], tensor) for name, tensor in tensors)


def test_opening_a_missing_segment_raises_file_not_found():
    with pytest.raises(FileNotFoundError):
        with wt.open_shared_memory_bucket({"segment": "shellrl_w_missing_0", "metadata": []}):
            pass
    with pytest.raises(ValueError, match="segment name"):
        with wt.open_shared_memory_bucket({"segment": "../etc/passwd", "metadata": []}):
            pass


def test_safetensors_dir_round_trip(tmp_path):
    tensors = _tensors()
    wt.save_safetensors_dir(tensors, tmp_path / "ckpt")
    loaded = dict(wt.load_safetensors_dir(tmp_path / "ckpt"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors)
    with pytest.raises(FileNotFoundError):
        wt.load_safetensors_dir(tmp_path)


def test_shared_memory_bucket_refill_reuses_the_segment():
    tensors = _tensors()
    with wt.SharedMemoryBucket(tensors) as bucket:
        name = bucket.name
        changed = [(n, t + 1) for n, t in tensors]
        payload = json.loads(bucket.refill(changed).payload())
        assert payload["segment"] == name
        with wt.open_shared_memory_bucket(payload) as views:
            assert all(torch.equal(v, t) for (_, v), (_, t) in zip(views, changed))
        with pytest.raises(ValueError, match="do not fit"):
            bucket.refill(tensors + [("big", torch.zeros(1000))])
