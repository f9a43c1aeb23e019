"""Which dtype a push travels in (services/learner/weights/weight_dtype.py): the engines' own 16-bit
dtype, never a cast down for an engine that serves float32 or does not say, and the bucket
sizes and layouts of a cast (split_buckets, SharedTensorBucket)."""

from __future__ import annotations

import json

import pytest
import torch

from services.learner.weights.weight_dtype import checkpoint_dtype, engine_dtype, push_dtype
from services.learner.weights.weight_transport import split_buckets
from shellrl.weights import safe_unpickle as wsu
from shellrl.weights import sglang as wsg
from shellrl.weights.bucket import unflatten_tensors


def test_auto_takes_the_engines_16_bit_dtype_and_never_casts_down_for_float32_or_unknown():
    assert push_dtype("auto", {"a": "bfloat16", "b": "bfloat16"})[0] == "bfloat16"
    assert push_dtype("auto", {"a": "float16"})[0] == "float16"
    assert push_dtype("auto", {"a": "bfloat16", "b": "float32"})[0] == "float32"
    dtype, why = push_dtype("auto", {"a": "bfloat16", "b": None})
    assert dtype == "float32" and "b" in why  # an engine that does not say: float32, said
    assert push_dtype("auto", {"a": "bfloat16", "b": "float16"})[0] == "float32"
    assert push_dtype("float32", {"a": "bfloat16"})[0] == "float32"
    assert push_dtype("bfloat16", {"a": "float16"})[0] == "bfloat16"  # asked for explicitly
    assert push_dtype("bfloat16", {"a": "float32"})[0] == "float32"  # never down for float32
    with pytest.raises(ValueError, match="weight_sync_dtype"):
        push_dtype("int8", {})


def test_an_engines_dtype_comes_from_its_server_info_or_the_checkpoint_when_it_says_auto(tmp_path):
    assert engine_dtype({"dtype": "bfloat16"}, None) == "bfloat16"
    assert engine_dtype({"dtype": "half"}, None) == "float16"  # SGLang's spelling
    assert engine_dtype({"dtype": "auto"}, "bfloat16") == "bfloat16"  # SGLang's default
    assert engine_dtype({"dtype": "auto"}, "float32") is None
    assert engine_dtype({}, "bfloat16") is None
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert checkpoint_dtype(tmp_path) == "float32"
    assert checkpoint_dtype(tmp_path / "absent") is None


def test_buckets_are_sized_and_laid_out_in_the_dtype_they_are_sent_in():
    named = [(f"w{i}", torch.randn(100)) for i in range(4)] + [("steps", torch.arange(3))]
    assert len(split_buckets(named, 500)) == 4  # float32: 400 bytes each, one a bucket
    assert len(split_buckets(named, 500, torch.bfloat16)) == 3  # bfloat16: 200 bytes, two a bucket
    bucket = wsg.SharedTensorBucket(named, dtype=torch.bfloat16)
    try:
        flat, metadata = wsu.decode_flattened_bucket(wsu.deserialize(bucket.entries(1)[0]))
        got = dict((m.name, m.dtype) for m in metadata)
        assert got == {**{f"w{i}": "bfloat16" for i in range(4)}, "steps": "int64"}
        for (name, tensor), (_, sent) in zip(named, unflatten_tensors(flat, metadata)):
            want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert torch.equal(sent, want), name
    finally:
        bucket.close()


def test_the_distributed_transport_streams_in_the_engines_dtype(tmp_path):
    """Cast, the distributed buckets stream through the two slots (as cuda_ipc): each is written
    in the cast when first asked for (the request names it, the bytes are the cast parameters in
    SGLang's unpadded layout), a slot takes bucket i+2 only after bucket i was answered, and the
    slots are refilled in place push after push. Without a cast, the parameters live in the kept
    buckets (share_parameters), as before."""
    import asyncio

    from services.learner.weights.weight_transport import WeightStaging
    from shellrl.weights import distributed as wdist

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    staging = WeightStaging("distributed", tmp_path, bucket_bytes=64, share_parameters=True)
    staging.dtype = torch.bfloat16

    async def push(version: int) -> tuple[dict, list]:
        prepared = staging.prepare(model, version, ["e"])
        stream, received, slots = prepared["stream"], {}, []
        for i, provider in enumerate(prepared["broadcast"]):
            fields, flat = await provider(1)
            assert set(fields["dtypes"]) == {"bfloat16"}
            metadata, nbytes = wdist.bucket_layout(**fields)  # the receiver's own layout
            assert flat.numel() == nbytes
            for meta in metadata:
                received[meta.name] = flat[meta.start_idx : meta.end_idx].view(torch.bfloat16)
            received = {k: v.clone() for k, v in received.items()}  # the slot is refilled
            slots.append(flat.data_ptr())
            stream.answered("e", i)
        stream.leave("e")
        staging.end_push()
        assert stream.filled_at_once <= 2
        return received, slots

    try:
        assert staging.casts(model) and staging.streams(model)
        # shm with shared parameters copies nothing and stays float32 (WeightStaging.casts)
        shm = WeightStaging("shm", tmp_path, share_parameters=True)
        assert not shm.casts(model) and WeightStaging("shm", tmp_path).casts(model)
        received, slots = asyncio.run(push(1))
        assert staging.bucket_count(model) == len(slots) > 2 and len(set(slots)) == 2
        for name, p in model.named_parameters():
            assert torch.equal(received[name], p.detach().to(torch.bfloat16).reshape(-1)), name
        with torch.no_grad():
            model[0].weight.add_(1.0)
        again, slots_again = asyncio.run(push(2))
        assert set(slots_again) == set(slots)  # the same two slots, refilled
        assert torch.equal(
            again["0.weight"], model[0].weight.detach().to(torch.bfloat16).reshape(-1)
        )
        staging.dtype = None  # a float32 engine: the learner's dtype, the parameters adopted
        assert not staging.streams(model)
        plain = staging.prepare(model, 3)["broadcast"]
        assert {d for fields, _ in plain for d in fields["dtypes"]} == {"float32"}
        assert model[0].weight.data_ptr() == plain[0][1].data_ptr()
    finally:
        staging.close()
