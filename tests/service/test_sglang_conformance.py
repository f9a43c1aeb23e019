"""Conformance with SGLang 0.5.23, judged by SGLang's own code (issue 16).

Every body the learner and the rollout send is captured from the real clients (EngineClient over an
httpx MockTransport that answers like SGLang) and checked with the released wheel's classes:
* tensor pushes: `UpdateWeightsFromTensorReqInput` (its base64 field) -> `MultiprocessingSerializer
  .deserialize` (SafeUnpickler allow-list) -> `FlattenedTensorBucket(...).reconstruct_tensors()`,
  bit for bit against the learner's parameters, for every TP rank's entry, in this process and in
  a second one (the CPU bytes travel through torch's file-system shared memory);
* the distributed path: `UpdateWeightsFromDistributedReqInput` -> `FlattenedTensorBucket.empty`
  filled with the bytes the learner broadcasts; `InitWeightsUpdateGroupReqInput`,
  `DestroyWeightsUpdateGroupReqInput`;
* control bodies against their io_struct classes; /generate bodies against the HTTP contract
  class `sglang.api.v1.api_types.GenerateRequest` and the server's `SamplingParams.verify`.
How SGLang's modules are imported without its GPU packages, and which stand-ins that takes:
tests/helpers/sglang_modules.py. Skipped only when sglang is not installed (`make setup` installs it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pydantic
import pytest
import torch

from tests.helpers.owned_processes import run_owned

if (
    importlib.util.find_spec("sglang") is None
):  # not importorskip: sglang/__init__.py needs GPU-side packages
    pytest.skip(
        "sglang is not installed (make setup installs sglang==0.5.23)", allow_module_level=True
    )

from services.learner.weights.weight_sync import WeightSync  # noqa: E402
from services.learner.weights.weight_transport import WeightStaging  # noqa: E402
from services.rollout.agent_loop import STOP_STRINGS  # noqa: E402
from shellrl.clients.engine import EngineClient  # noqa: E402
from shellrl.models import load_model  # noqa: E402
from shellrl.weights import distributed as wdist  # noqa: E402
from tests.helpers import sglang_modules  # noqa: E402
from tests.helpers.processes import REPO  # noqa: E402

URL = "http://sglang.test:30000"
TP_SIZE = 2


@pytest.fixture(scope="module")
def sgl():
    modules = sglang_modules.load()
    assert modules.version == "0.5.23"
    return modules


class FakeSGLang:
    """Answers like SGLang 0.5.23's HTTP server (success bodies only) and records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, object]] = []
        self.version = "0"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.requests.append((path, body))
        if isinstance(body, dict) and body.get("weight_version") is not None:
            self.version = body["weight_version"]
        if path == "/model_info":
            return httpx.Response(200, json={"weight_version": self.version, "model_path": "m"})
        if path == "/server_info":
            return httpx.Response(
                200, json={"version": "0.5.23", "tp_size": TP_SIZE, "frontend": "python"}
            )
        if path == "/generate":
            return httpx.Response(
                200,
                json={
                    "text": "x",
                    "output_ids": [5],
                    "meta_info": {
                        "id": body["rid"],
                        "finish_reason": {"type": "length", "length": 1},
                        "prompt_tokens": 3,
                        "completion_tokens": 1,
                        "output_token_logprobs": [[-0.5, 5, None]],
                        "weight_version": "1",
                        "weight_versions": [{"version": "1", "start": 0, "end": 1}],
                    },
                },
            )
        if path in ("/abort_request",):
            return httpx.Response(200)
        if path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        if path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={"message": "ok", "status": "ok"})
        return httpx.Response(
            200, json={"success": True, "message": "Success.", "num_paused_requests": 0}
        )

    def bodies(self, path: str) -> list:
        return [b for p, b in self.requests if p == path]


def _client(fake: FakeSGLang) -> EngineClient:
    return EngineClient([URL], transport=httpx.MockTransport(fake))


def _validate(struct, body: dict):
    """What SGLang's FastAPI route does with the JSON body (`Annotated[<struct>, Body()]`)."""
    return pydantic.TypeAdapter(struct).validate_python(body)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _digests(named) -> list[tuple[str, str]]:
    return [(n, hashlib.sha256(_bits(t).numpy().tobytes()).hexdigest()) for n, t in named]


DECODE_IN_ANOTHER_PROCESS = """
import hashlib, json, sys
from tests.helpers import sglang_modules
sgl = sglang_modules.load()
obj = sgl.common.MultiprocessingSerializer.deserialize(sys.stdin.read().strip())
bucket = sgl.tensor_bucket.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
print(json.dumps([(n, hashlib.sha256(t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
                   .hexdigest()) for n, t in bucket.reconstruct_tensors()]))
"""


async def test_every_tensor_push_decodes_with_sglangs_own_code_bit_for_bit_for_every_tp_rank(
    sgl, tmp_path
):
    model = load_model("tiny")
    fake = FakeSGLang()
    client = _client(fake)
    sync = WeightSync(
        client,
        None,
        transport="shm",
        deadline_s=30,
        sync_dir=tmp_path,
        bucket_bytes=1 << 20,
        share_parameters=True,
    )
    try:
        result = await sync.push(model, 1)
        assert result.confirmed == (URL,), result.failed
        bodies = fake.bodies("/update_weights_from_tensor")
        assert len(bodies) >= 2  # several buckets: the last one flushes the cache
        assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]
        # the version only with the last bucket (SGLang records each one it is given at once),
        # all of it inside a retract pause (the default for a push of several buckets)
        assert [b["weight_version"] for b in bodies] == [None] * (len(bodies) - 1) + ["1"]
        calls = [p for p, _ in fake.requests if p not in ("/model_info", "/server_info")]
        assert calls == [
            "/pause_generation",
            "/begin_weight_update",
            *["/update_weights_from_tensor"] * len(bodies),
            "/end_weight_update",
            "/continue_generation",
        ]
        assert fake.bodies("/pause_generation") == [{"mode": "retract"}]
        received = []
        for body in bodies:
            request = _validate(sgl.io_struct.UpdateWeightsFromTensorReqInput, body)
            assert request.load_format == "flattened_bucket"
            assert request.weight_version == ("1" if body is bodies[-1] else None)
            assert len(request.serialized_named_tensors) == TP_SIZE and all(
                isinstance(e, bytes) for e in request.serialized_named_tensors
            )
            for rank_entry in request.serialized_named_tensors:  # what SGLang's TP rank r reads
                obj = sgl.common.MultiprocessingSerializer.deserialize(rank_entry)
                assert isinstance(obj["metadata"][0], sgl.tensor_bucket.FlattenedTensorMetadata)
                bucket = sgl.tensor_bucket.FlattenedTensorBucket(
                    flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
                )
                tensors = bucket.reconstruct_tensors()
                ends = [m.end_idx for m in obj["metadata"]]
                assert [m.start_idx for m in obj["metadata"]] == [0, *ends[:-1]]  # unpadded
                received.append(tensors)
            assert [n for n, _ in received[-1]] == [n for n, _ in received[-2]]
        got = {n: t for tensors in received[::TP_SIZE] for n, t in tensors}
        expected = dict(model.named_parameters())
        assert list(got) == list(expected)
        for name, tensor in got.items():
            assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape
            assert torch.equal(_bits(tensor), _bits(expected[name])), name

        last = bodies[-1]["serialized_named_tensors"][0]  # a second process reads the shared memory
        out = run_owned(
            [sys.executable, "-c", DECODE_IN_ANOTHER_PROCESS],
            input=last,
            cwd=REPO,
            text=True,
            capture_output=True,
            timeout_s=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert [tuple(p) for p in json.loads(out.stdout)] == _digests(received[-1])
    finally:
        sync.close()
        await client.close()


class DecodingSGLang(FakeSGLang):
    """FakeSGLang serving bfloat16 ("dtype" in /server_info) that decodes each tensor push with
    SGLang's own code during the call, as SGLang's scheduler copies the bucket before it answers:
    a streamed push refills a slot once the call for its bucket returned."""

    def __init__(self, sgl) -> None:
        super().__init__()
        self.sgl, self.decoded = sgl, []  # per call: [(name, tensor) per TP rank]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            info = {"version": "0.5.23", "tp_size": TP_SIZE, "dtype": "bfloat16"}
            return httpx.Response(200, json=info)
        if request.url.path == "/update_weights_from_tensor":
            body = _validate(
                self.sgl.io_struct.UpdateWeightsFromTensorReqInput, json.loads(request.content)
            )
            ranks = []
            for rank_entry in body.serialized_named_tensors:
                obj = self.sgl.common.MultiprocessingSerializer.deserialize(rank_entry)
                bucket = self.sgl.tensor_bucket.FlattenedTensorBucket(
                    flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
                )
                ranks.append([(n, t.clone()) for n, t in bucket.reconstruct_tensors()])
            self.decoded.append(ranks)
        return super().__call__(request)


async def test_a_streamed_bf16_push_decodes_with_sglangs_own_code_in_every_call(sgl, tmp_path):
    """Unshared shm streams through two slots (the cuda_ipc schedule, on CPU) in the dtype
    SGLang reports: every bucket decodes with SGLang's deserializer in bfloat16, equal to the
    learner's float32 parameters cast, for every TP rank."""
    model = load_model("tiny")
    fake = DecodingSGLang(sgl)
    client = _client(fake)
    sync = WeightSync(
        client,
        None,
        transport="shm",
        deadline_s=30,
        sync_dir=tmp_path,
        bucket_bytes=40_000,
        share_parameters=False,
    )
    try:
        result = await sync.push(model, 1)
        assert result.confirmed == (URL,), result.failed
        assert sync.push_dtype == "bfloat16" and sync.staging.stream.filled_at_once <= 2
        assert len(fake.decoded) == len(sync.staging.stream.buckets) > 2
        bodies = fake.bodies("/update_weights_from_tensor")
        assert [b["weight_version"] for b in bodies] == [None] * (len(bodies) - 1) + ["1"]
        assert fake.bodies("/pause_generation") == [{"mode": "retract"}]  # several buckets
        for ranks in fake.decoded:
            assert len(ranks) == TP_SIZE and [n for n, _ in ranks[0]] == [n for n, _ in ranks[1]]
        got = {n: t for ranks in fake.decoded for n, t in ranks[0]}
        expected = dict(model.named_parameters())
        assert list(got) == list(expected)
        for name, tensor in got.items():
            want = expected[name].detach().to(torch.bfloat16)
            assert tensor.dtype == torch.bfloat16 and torch.equal(_bits(tensor), _bits(want)), name
    finally:
        sync.close()
        await client.close()


async def test_the_distributed_path_speaks_sglangs_structs_and_its_receive_layout(sgl, tmp_path):
    model = load_model("tiny")
    fake = FakeSGLang()
    client = _client(fake)
    staging = WeightStaging("distributed", tmp_path, bucket_bytes=1 << 20)
    try:
        await client.init_weights_update_group(
            "10.0.0.1", 29500, 1, 3, group_name="g", backend="gloo"
        )
        init = _validate(
            sgl.io_struct.InitWeightsUpdateGroupReqInput,
            fake.bodies("/init_weights_update_group")[0],
        )
        assert (
            init.master_address,
            init.master_port,
            init.rank_offset,
            init.world_size,
            init.group_name,
            init.backend,
        ) == ("10.0.0.1", 29500, 1, 3, "g", "gloo")
        received = {}
        prepared = staging.prepare(model, 1, [URL])  # streamed through two slots (unshared)
        for i, provider in enumerate(prepared["broadcast"]):
            fields, flat = await provider(1)
            await client.update_weights_from_distributed(
                **fields, group_name="g", weight_version="1"
            )
            request = _validate(
                sgl.io_struct.UpdateWeightsFromDistributedReqInput,
                fake.bodies("/update_weights_from_distributed")[-1],
            )
            assert request.load_format == "flattened_bucket" and request.group_name == "g"
            bucket = sgl.tensor_bucket.FlattenedTensorBucket.empty(
                request.names, request.dtypes, request.shapes, "cpu"
            )
            assert bucket.get_flattened_tensor().numel() == flat.numel()  # the same unpadded layout
            bucket.get_flattened_tensor().copy_(flat)  # what the broadcast delivers
            received.update((n, t.clone()) for n, t in bucket.reconstruct_tensors())
            prepared["stream"].answered(URL, i)  # its slot may take bucket i + 2
        prepared["stream"].leave(URL)
        for name, tensor in model.named_parameters():
            assert torch.equal(_bits(received[name]), _bits(tensor)), name
        await client.destroy_weights_update_group("g")
        _validate(
            sgl.io_struct.DestroyWeightsUpdateGroupReqInput,
            fake.bodies("/destroy_weights_update_group")[0],
        )
        assert wdist.request_fields([("x", torch.zeros(2, 3, dtype=torch.bfloat16))]) == {
            "names": ["x"],
            "dtypes": ["bfloat16"],
            "shapes": [[2, 3]],
        }
    finally:
        staging.close()
        await client.close()


async def test_every_control_body_validates_against_its_io_struct_class(sgl, tmp_path):
    fake = FakeSGLang()
    client = _client(fake)
    io = sgl.io_struct
    try:
        sync = WeightSync(client, None, transport="disk", deadline_s=30, sync_dir=tmp_path)
        await sync.push(load_model("tiny"), 3)
        for mode in ("abort", "retract", "in_place"):
            await client.pause_generation(mode)
        await client.continue_generation()
        await client.abort_request("traj-1-t0-r0")
        await client.abort_request(abort_all=True)
        await client.flush_cache()
        await client.begin_weight_update()
        await client.end_weight_update()
        checks = {
            "/update_weights_from_disk": io.UpdateWeightFromDiskReqInput,
            "/pause_generation": io.PauseGenerationReqInput,
            "/continue_generation": io.ContinueGenerationReqInput,
            "/abort_request": io.AbortReq,
            "/begin_weight_update": io.BeginWeightUpdateReqInput,
            "/end_weight_update": io.EndWeightUpdateReqInput,
        }
        for path, struct in checks.items():
            bodies = fake.bodies(path)
            assert bodies, path
            for body in bodies:
                _validate(struct, body)
        disk = _validate(
            io.UpdateWeightFromDiskReqInput, fake.bodies("/update_weights_from_disk")[0]
        )
        assert (
            disk.weight_version == "3"
            and disk.flush_cache
            and disk.model_path.endswith("v00000003")
        )
        assert [
            _validate(io.PauseGenerationReqInput, b).mode for b in fake.bodies("/pause_generation")
        ] == ["abort", "retract", "in_place"]
        assert fake.bodies("/flush_cache") == [None]  # SGLang's /flush_cache takes no body
    finally:
        await client.close()


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0, "top_p": 1.0, "top_k": -1},  # the rollout's defaults
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1},  # greedy (evaluation)
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
    ],
)
async def test_every_generate_body_the_rollout_sends_passes_sglangs_contract_and_sampling_checks(
    sgl, sampling
):
    fake = FakeSGLang()
    client = _client(fake)
    try:
        # the rollout's sampling_params (services/rollout/agent_loop.py, AgentLoop._generate_turn)
        params = {
            **sampling,
            "max_new_tokens": 512,
            "stop": list(STOP_STRINGS),
            "stop_token_ids": [2],
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        await client.generate([1, 2, 3], params, return_logprob=True, rid="traj-1-t0-r0")
        body = fake.bodies("/generate")[0]
        request = sgl.api_types.GenerateRequest.from_json_value(body)  # the HTTP contract gate
        assert (
            request.input_ids == [1, 2, 3]
            and request.rid == "traj-1-t0-r0"
            and request.return_logprob
        )
        sgl.sampling_params.SamplingParams(**body["sampling_params"]).verify(vocab_size=49152)
    finally:
        await client.close()


def test_our_allow_list_is_sglangs_less_what_shellrl_refuses(sgl):
    """shellrl's engine resolves no global that SGLang's SafeUnpickler would refuse."""
    from shellrl.weights import safe_unpickle as wsu

    theirs = sgl.common.SafeUnpickler.ALLOWED_GLOBALS
    assert wsu.ALLOWED_GLOBALS <= theirs
    stand_ins = set(wsu._STAND_INS) - {("torch.storage", "_load_from_bytes")}
    assert stand_ins <= theirs
    missing = theirs - wsu.ALLOWED_GLOBALS - set(wsu._REFUSED) - stand_ins
    assert all(m.startswith(("sglang.", "torch_npu.")) for m, _ in missing), (
        missing
    )  # SGLang's own containers


def _sglang_auth_levels() -> dict[str, str]:
    """{route path: its `auth_level` (AuthLevel member name; NORMAL when undecorated)} read from
    the wheel's http_server.py: the `@app.get/post/api_route("<path>")` and `@auth_level(...)`
    decorators of each endpoint."""
    import ast

    srt = Path(importlib.import_module("sglang.srt.utils.auth").__file__).parents[1]
    tree = ast.parse((srt / "entrypoints" / "http_server.py").read_text())
    levels = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        paths, level = [], "NORMAL"
        for decorator in node.decorator_list:
            if not isinstance(decorator, ast.Call):
                continue
            name = getattr(decorator.func, "attr", getattr(decorator.func, "id", None))
            if name in ("get", "post", "put", "api_route") and decorator.args:
                if isinstance(decorator.args[0], ast.Constant):
                    paths.append(decorator.args[0].value)
            if name == "auth_level":
                level = ast.unparse(decorator.args[0]).rsplit(".", 1)[-1]
        levels.update({p: level for p in paths})
    return levels


class RecordingSGLang(FakeSGLang):
    """FakeSGLang that also records each request's method and Authorization header."""

    def __init__(self) -> None:
        super().__init__()
        self.auth: list[tuple[str, str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.auth.append((request.method, request.url.path, request.headers.get("authorization")))
        return super().__call__(request)


API_KEY, ADMIN_KEY = "api-key-for-every-route-0123456789", "admin-key-for-weights-0123456789"


async def test_the_admin_key_goes_where_sglangs_own_auth_asks_for_it(sgl, tmp_path):
    """With SGLang's --api-key and --admin-api-key both set, SGLang's own decision function
    (sglang/srt/utils/auth.py `decide_request_auth`, at each route's level read from the wheel)
    lets every request of a learner's push, pause, flush and abort through, and a generate and
    the info reads carry the api key."""
    from shellrl.clients.engine_fleet import ADMIN_PATHS

    auth = importlib.import_module("sglang.srt.utils.auth")
    levels = _sglang_auth_levels()
    assert {p for p in ADMIN_PATHS if levels.get(p) != "ADMIN_OPTIONAL"} == set()
    fake = RecordingSGLang()
    client = EngineClient(
        [URL],
        transport=httpx.MockTransport(fake),
        api_token=API_KEY,
        admin_api_token=ADMIN_KEY,
    )
    sync = WeightSync(
        client, None, transport="shm", deadline_s=30, sync_dir=tmp_path, bucket_bytes=1 << 20
    )
    try:
        await sync.push(load_model("tiny"), 1)  # pause, begin, buckets, end, continue, read back
        await client.flush_cache()
        await client.abort_request(abort_all=True)
        await client.generate([1, 2, 3], {"max_new_tokens": 1})
        await client.health()
        await client.init_weights_update_group(
            "10.0.0.1", 29500, 1, 2, group_name="g", backend="gloo"
        )
        await client.destroy_weights_update_group("g")
        called = {path for _, path, _ in fake.auth}
        assert {"/update_weights_from_tensor", "/pause_generation", "/generate"} <= called
        for method, path, header in fake.auth:
            level = auth.AuthLevel[levels.get(path, "NORMAL")]
            decision = auth.decide_request_auth(
                method=method,
                path=path,
                authorization_header=header,
                api_key=API_KEY,
                admin_api_key=ADMIN_KEY,
                auth_level=level,
            )
            assert decision.allowed, (method, path, header)
            if path not in ("/health", "/health_generate"):
                expected = ADMIN_KEY if level == auth.AuthLevel.ADMIN_OPTIONAL else API_KEY
                assert header == f"Bearer {expected}", path
    finally:
        sync.close()
        await client.close()


async def test_in_place_is_refused_against_sglang_with_its_radix_cache_on(tmp_path):
    """SGLang refuses the last bucket's flush while a batch is paused in place; the first push
    stops with one line naming the setting instead of loading weights it would then disown."""
    from services.learner.weights.push_setup import PauseModeRefused

    fake = FakeSGLang()  # its /server_info has no disable_radix_cache: SGLang's default, on
    client = _client(fake)
    sync = WeightSync(
        client, None, transport="shm", deadline_s=30, sync_dir=tmp_path, pause_mode="in_place"
    )
    try:
        with pytest.raises(PauseModeRefused, match="SHELLRL_WEIGHT_SYNC_PAUSE=in_place"):
            await sync.push(load_model("tiny"), 1)
        assert fake.bodies("/update_weights_from_tensor") == []
    finally:
        sync.close()
        await client.close()


class FlushRefusingSGLang(FakeSGLang):
    """SGLang whose last bucket loads, records the version, then answers `success: false`
    (a flush refused after loading, scheduler_components/weight_updater.py 120-133)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        response = super().__call__(request)
        body = json.loads(request.content) if request.content else None
        if request.url.path == "/update_weights_from_tensor" and body["flush_cache"]:
            return httpx.Response(
                400,
                json={"success": False, "message": "Cache flush failed", "num_paused_requests": 0},
            )
        return response


async def test_an_engine_that_reports_the_new_version_after_an_error_stays_in_rotation(tmp_path):
    fake = FlushRefusingSGLang()
    client = _client(fake)
    sync = WeightSync(client, None, transport="shm", deadline_s=30, sync_dir=tmp_path)
    try:
        result = await sync.push(load_model("tiny"), 1)
        assert result.confirmed == (URL,) and result.failed == {}
        assert sync.engines[URL].in_rotation and sync.engines[URL].version == "1"
    finally:
        sync.close()
        await client.close()
