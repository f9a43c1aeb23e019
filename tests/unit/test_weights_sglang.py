"""SGLang's envelope (shellrl.weights.sglang) and the distributed layout (shellrl.weights.distributed),
without sglang itself: round trips through our own reader, and what the allow-list refuses. The
same bytes decoded by SGLang's own code: tests/service/test_sglang_conformance.py."""

from __future__ import annotations

import base64
import os
import pickle
import sys

import pytest
import torch

from services.learner.weights.weight_transport import choose_transport, engine_transport
from shellrl.weights import distributed as wdist
from shellrl.weights import safe_unpickle as wsu
from shellrl.weights import sglang as wsg
from shellrl.weights.bucket import unflatten_tensors
from tests.helpers.owned_processes import run_owned


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(4, 3, generator=g)),
        ("a.bias", torch.randn(3, generator=g)),
        ("b.weight", torch.randn(2, 5, generator=g)),
    ]


class _RunsACommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_shared_tensor_bucket_round_trips_with_unpadded_offsets_and_one_entry_per_rank():
    named = _named()
    with wsg.SharedTensorBucket(named) as bucket:
        entries = bucket.entries(2)
        assert len(entries) == 2 and entries[0] == entries[1]
        buffer, metadata = wsu.decode_flattened_bucket(wsu.deserialize(entries[0]))
        assert [m.start_idx for m in metadata] == [
            0,
            48,
            60,
        ]  # each tensor right after the previous
        assert buffer.numel() == 100
        for (name, tensor), (name2, got) in zip(named, unflatten_tensors(buffer, metadata)):
            assert name == name2 and torch.equal(tensor, got)
        wsu.deserialize(entries[1])  # the second rank's reference


def test_adopted_parameters_are_what_the_receiver_reads_and_a_refill_copies_nothing():
    params = [torch.nn.Parameter(t.clone()) for _, t in _named()]
    named = [(n, p.detach()) for (n, _), p in zip(_named(), params)]
    with wsg.SharedTensorBucket(named) as bucket:
        bucket.adopt(params)
        buffer, metadata = wsu.decode_flattened_bucket(wsu.deserialize(bucket.entries(1)[0]))
        with torch.no_grad():
            params[0].add_(1.0)  # the optimizer writes where the engine reads
        assert bucket.refill([(n, p.detach()) for (n, _), p in zip(named, params)]) is bucket
        assert torch.equal(
            dict(unflatten_tensors(buffer, metadata))["a.weight"], params[0].detach()
        )


def test_a_pickle_that_would_run_a_command_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    entry = base64.b64encode(pickle.dumps(_RunsACommand(f"touch {marker}"))).decode()
    with pytest.raises(
        wsu.EnvelopeError, match="never unpickled.*blocked global (posix|os).system"
    ):
        wsu.deserialize(entry)
    assert not marker.exists()


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{not base64}", "expected base64"),
        (base64.b64encode(b"not a pickle").decode(), "cannot unpickle"),
        (base64.b64encode(pickle.dumps(print)).decode(), "blocked global builtins.print"),
    ],
)
def test_bad_entries_are_refused_naming_the_field(entry, message):
    with pytest.raises(wsu.EnvelopeError, match=message) as info:
        wsu.deserialize(entry, "serialized_named_tensors[0]")
    assert info.value.field == "serialized_named_tensors[0]"


def test_metadata_overrunning_the_buffer_or_with_an_unknown_dtype_is_refused():
    buffer = torch.zeros(16, dtype=torch.uint8)
    good = wsg.FlattenedTensorMetadata("x", torch.Size([4]), torch.float32, 0, 16, 16)
    assert wsu.decode_flattened_bucket({"flattened_tensor": buffer, "metadata": [good]})[1][
        0
    ].shape == (4,)
    overrun = wsg.FlattenedTensorMetadata("x", torch.Size([4]), torch.float32, 8, 24, 16)
    with pytest.raises(wsu.EnvelopeError, match=r"metadata\[0\].end_idx: .*overrun"):
        wsu.decode_flattened_bucket({"flattened_tensor": buffer, "metadata": [overrun]})
    fp8 = wsg.FlattenedTensorMetadata("x", torch.Size([16]), torch.float8_e4m3fn, 0, 16, 16)
    with pytest.raises(wsu.EnvelopeError, match=r"metadata\[0\].dtype: unsupported dtype"):
        wsu.decode_flattened_bucket({"flattened_tensor": buffer, "metadata": [fp8]})
    with pytest.raises(wsu.EnvelopeError, match="flattened_tensor"):
        wsu.decode_flattened_bucket({"flattened_tensor": buffer.float(), "metadata": [good]})


def test_a_storage_claimed_larger_than_its_shm_file_is_refused_and_the_file_is_not_grown():
    storage = torch.UntypedStorage._new_using_filename_cpu(1000)
    manager, handle, size = storage._share_filename_cpu_()
    before = os.stat(b"/dev/shm" + handle).st_size
    with pytest.raises(pickle.UnpicklingError, match="claimed"):
        wsu._checked_rebuild_storage_filename(torch.UntypedStorage, manager, handle, 10**6)
    with pytest.raises(pickle.UnpicklingError, match="not a torch shm file"):
        wsu._checked_rebuild_storage_filename(torch.UntypedStorage, manager, b"/../etc/passwd", 10)
    assert os.stat(b"/dev/shm" + handle).st_size == before


def test_cpu_tensors_shared_by_file_descriptor_are_refused_with_the_reason():
    code = (
        "import base64, io, torch, torch.multiprocessing\n"
        "from multiprocessing.reduction import ForkingPickler\n"
        "b = io.BytesIO(); ForkingPickler(b).dump(torch.ones(4)); print(base64.b64encode(b.getvalue()).decode())"
    )
    entry = run_owned(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout_s=120
    ).stdout.strip()
    with pytest.raises(wsu.EnvelopeError, match="file descriptor|file_system"):
        wsu.deserialize(entry)


def test_the_distributed_layout_is_unpadded_and_bad_fields_are_named():
    metadata, nbytes = wdist.bucket_layout(["a", "b"], ["float32", "bfloat16"], [[2, 3], [5]])
    assert [(m.start_idx, m.end_idx) for m in metadata] == [(0, 24), (24, 34)] and nbytes == 34
    with pytest.raises(wdist.GroupError, match=r"dtypes\[1\]: unsupported dtype 'float33'"):
        wdist.bucket_layout(["a", "b"], ["float32", "float33"], [[2], [2]])
    with pytest.raises(wdist.GroupError, match=r"shapes\[0\]"):
        wdist.bucket_layout(["a"], ["float32"], [[-1]])
    with pytest.raises(
        wdist.GroupError, match=r"dtypes\[1\]: b: byte offset 2"
    ):  # as FlattenedTensorBucket.empty
        wdist.bucket_layout(["a", "b"], ["bfloat16", "float32"], [[1], [1]])
    with pytest.raises(wdist.GroupError, match="names"):
        wdist.bucket_layout(["a"], ["float32", "float32"], [[1]])


def test_a_group_request_that_cannot_work_is_refused_before_any_rendezvous():
    groups = wdist.ReceiverGroups("cpu", timeout_s=1.0)
    with pytest.raises(wdist.GroupError, match="world_size"):
        groups.check_init(rank_offset=1, world_size=1, group_name="g", backend="gloo")
    with pytest.raises(wdist.GroupError, match="rank_offset"):
        groups.check_init(rank_offset=0, world_size=2, group_name="g", backend="gloo")
    with pytest.raises(wdist.GroupError, match="backend: nccl needs a CUDA engine"):
        groups.check_init(rank_offset=1, world_size=2, group_name="g", backend="nccl")
    with pytest.raises(wdist.GroupError, match="group_name: no live group"):
        groups.receive("g", ["a"], ["float32"], [[1]], "flattened_bucket")
    with pytest.raises(wdist.GroupError, match="group_name: no live group"):
        groups.destroy("g")


def test_auto_sends_cuda_ipc_to_any_gpu_engine_and_shm_to_an_engine_on_cpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert choose_transport("auto", gpu, ["http://localhost:30000"]) == "cuda_ipc"
    ours_gpu = {"version": "shellrl-engine-0.1.0", "device": "cuda:0"}
    assert engine_transport("cuda_ipc", ours_gpu) == "cuda_ipc"
    ours_cpu = {"version": "shellrl-engine-0.1.0", "device": "cpu"}
    assert engine_transport("cuda_ipc", ours_cpu) == "shm"
    # SGLang's /server_info carries its server arguments; `device` defaults to "cuda"
    assert engine_transport("cuda_ipc", {"version": "0.5.23", "tp_size": 1}) == "cuda_ipc"
    assert engine_transport("cuda_ipc", {"version": "0.5.23", "device": "cpu"}) == "shm"
    assert engine_transport("shm", {"version": "0.5.23"}) == "shm"
    assert choose_transport("auto", cpu, ["http://10.0.0.7:30000"]) == "disk"


def test_a_spliced_envelope_decodes_like_one_pickle_of_the_whole_dict():
    named = _named()
    with wsg.SharedTensorBucket(named) as bucket:
        flat = bucket._flat[: bucket.nbytes]
        envelope = wsg.BucketEnvelope()
        first, second = (
            envelope.serialize(flat, bucket.metadata),
            envelope.serialize(flat, bucket.metadata),
        )
        assert first == second  # a CPU storage keeps its shm name: the same bytes
        for data in (first, second):
            buffer, metadata = wsu.decode_flattened_bucket(wsu.deserialize(data))
            assert metadata == bucket.metadata
            for (name, tensor), (name2, got) in zip(named, unflatten_tensors(buffer, metadata)):
                assert name == name2 and torch.equal(tensor, got)


def test_the_cuda_rebuild_is_pickled_under_sglangs_path_and_read_back_as_our_stand_in():
    data = wsg.serialize(wsg.rebuild_cuda_tensor_by_uuid)
    assert b"sglang.srt.utils.patch_torch" in data and b"_rebuild_cuda_tensor_modified" in data
    assert b"shellrl" not in data
    assert wsu.deserialize(data) is wsg.rebuild_cuda_tensor_by_uuid
