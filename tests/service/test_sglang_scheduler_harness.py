"""The learner's multi-bucket bf16 push into SGLang 0.5.23's own scheduler-side weight-update code,
TP = 2 in two processes (issue 30 item 7).

Two TP ranks (tests/helpers/sglang_tp_rank.py) run the wheel's `SchedulerWeightUpdaterManager`
(begin -> buckets -> end, the flush after the last bucket, the version recording), the model
runner's `WeightUpdater` loaders (flattened bucket from a tensor envelope; bucketed receive of a
gloo broadcast), the TP worker's own-rank deserializer and the scheduler's pause, resume and flush,
over a gloo TP group; which of their imports stand in, and why: tests/helpers/sglang_scheduler.py.
The learner's real WeightSync and EngineClient talk to them through an HTTP front that plays
SGLang's server and tokenizer manager (tests/fakes/sglang_front.py). Each rank holds 3
generations in its running batch, so a pause has something to retract or keep.

Model: Qwen2.5-0.5B's tensors at their real shapes (the config of benchmarks.model_shapes; its
151,936 x 896 embedding, the largest tensor, included) with the layer count scaled from 24 to 2,
random float32 weights on the learner, bfloat16 on the engine; 32 MiB buckets, so the push takes
several (the embedding, larger than a bucket, goes alone).

Asserted for the default pause (auto = retract) through shm and through the gloo distributed
path: every parameter bit for bit equal to the learner's cast to bfloat16 on both ranks; the
version recorded once, after the last bucket, with every tensor loaded; the pause held from
begin to end and no wait for generations; the last bucket's flush accepted; nothing left open
(sessions, the learner's shm files, process groups). in_place and off show what they do.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import sys
from multiprocessing.connection import Listener
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import sglang_modules

pytest.importorskip("transformers")
if not sglang_modules.installed():
    pytest.skip(
        "sglang is not installed (make setup installs sglang==0.5.23)", allow_module_level=True
    )

from services.learner.weights.push_setup import PauseModeRefused  # noqa: E402
from services.learner.weights.weight_sync import WeightSync  # noqa: E402
from shellrl.clients.engine import EngineClient  # noqa: E402
from tests.fakes.sglang_front import SGLangFront  # noqa: E402
from tests.helpers.owned_processes import popen_owned, stop_owned  # noqa: E402
from tests.helpers.processes import REPO  # noqa: E402
from tests.helpers.redis_server import free_port  # noqa: E402

URL = "http://sglang.test:30000"
TP_SIZE, LAYERS, IN_FLIGHT = 2, 2, 3
BUCKET_BYTES = 32 << 20


def learner_model(seed: int = 0) -> torch.nn.Module:
    """Qwen2.5-0.5B's architecture (LAYERS layers), float32, random weights."""
    from transformers import Qwen2ForCausalLM

    from benchmarks.model_shapes import qwen2_config

    config = qwen2_config("qwen2.5-0.5b")
    config.num_hidden_layers = LAYERS
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return model.requires_grad_(False)


def bf16_digests(model: torch.nn.Module) -> dict[str, str]:
    return {
        name: hashlib.sha256(
            p.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy()
        ).hexdigest()
        for name, p in model.named_parameters()
    }


def torch_shm_files() -> set[str]:
    """torch's file-system shared memory files this process made (/dev/shm/torch_<pid>_...)."""
    return {p.name for p in Path("/dev/shm").glob(f"torch_{os.getpid()}_*")}


class Engine:
    """The two TP rank processes and their connections, in rank order."""

    def __init__(self, tmp: Path, shapes: dict) -> None:
        key = secrets.token_bytes(16)
        self.listener = Listener(str(tmp / "harness.sock"), family="AF_UNIX", authkey=key)
        tp_port = free_port()
        env = {**os.environ, "SGLANG_HARNESS_KEY": key.hex(), "PYTHONPATH": str(REPO)}
        self.procs = [
            popen_owned(
                [
                    sys.executable,
                    "-m",
                    "tests.helpers.sglang_tp_rank",
                    self.listener.address,
                    str(rank),
                    str(TP_SIZE),
                    str(tp_port),
                    json.dumps(shapes),
                    str(IN_FLIGHT),
                ],
                cwd=REPO,
                env=env,
            )
            for rank in range(TP_SIZE)
        ]
        conns = {}
        for _ in range(TP_SIZE):
            conn = self.listener.accept()
            _, rank = conn.recv()
            conns[rank] = conn
        self.conns = [conns[r] for r in range(TP_SIZE)]
        self.closed = False

    def ask(self, op: str, body=None) -> list:
        return asyncio.run(SGLangFront(self.conns).ask(op, body))

    def close(self) -> list[dict]:
        """Stop the ranks; what each said it still held."""
        self.closed = True
        byes = []
        for conn in self.conns:
            conn.send(("exit", None))
            byes.append(conn.recv()[1])
            conn.close()
        for proc in self.procs:
            assert proc.wait(timeout=60) == 0
        self.listener.close()
        return byes


@pytest.fixture(scope="module")
def model():
    return learner_model()


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    """The module's TP ranks, started again for the tests after one that closed them (the
    ranks-end test may run first in a random order)."""
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    started: list[Engine] = []

    def live() -> Engine:
        if not started or started[-1].closed:
            started.append(Engine(tmp_path_factory.mktemp("sglang-harness"), shapes))
        return started[-1]

    try:
        yield live
    finally:
        for engine in started:
            for proc in engine.procs:
                if proc.poll() is None:
                    stop_owned(proc)


@pytest.fixture
def engine(engines) -> Engine:
    return engines()


def _requeue(engine: Engine) -> None:
    """What the scheduler's loop does after continue_generation: waiting requests run again, and
    the batch holds IN_FLIGHT generations."""
    engine.ask("requeue", IN_FLIGHT)


async def _push(front: SGLangFront, model, version: int, tmp_path, **sync_args):
    client = EngineClient([URL], transport=httpx.MockTransport(front))
    sync = WeightSync(
        client,
        None,
        deadline_s=60,
        sync_dir=tmp_path,
        bucket_bytes=BUCKET_BYTES,
        **sync_args,
    )
    try:
        result = await sync.push(model, version)
        groups = None if sync.groups is None else list(sync.groups._groups.values())
        return result, sync, groups
    finally:
        await sync.aclose()  # the learner's shutdown: the engine destroys its group too
        await client.close()


def _perturb(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5)


@pytest.mark.parametrize("transport", ["shm", "distributed"])
def test_a_multi_bucket_bf16_push_loads_exactly_under_one_retract_pause(
    engine, model, transport, tmp_path
):
    _perturb(model)
    _requeue(engine)
    version = {"shm": 1, "distributed": 2}[transport]
    front = SGLangFront(engine.conns)
    before_files = torch_shm_files()
    args = (
        {"share_parameters": False}  # shared parameters stay float32 (WeightStaging.casts)
        if transport == "shm"
        else {"backend": "gloo", "master_address": "127.0.0.1"}
    )
    result, sync, groups = asyncio.run(
        _push(front, model, version, tmp_path, transport=transport, **args)
    )
    assert result.confirmed == (URL,), result.failed
    assert sync.push_dtype == "bfloat16"
    calls = [path for path, _, _ in front.log]
    updates = front.updates()
    assert len(updates) >= 3, calls
    head = ["/init_weights_update_group"] if transport == "distributed" else []
    tail = ["/destroy_weights_update_group"] if transport == "distributed" else []
    assert calls == [
        "/pause_generation",
        "/begin_weight_update",
        *head,
        *[calls[2 + len(head)]] * len(updates),
        "/end_weight_update",
        "/continue_generation",
        *tail,
    ]
    assert front.log[0][1] == {"mode": "retract"}
    # the version only with the last bucket, the flush only with the last, all of it paused
    assert [b["weight_version"] for b, _ in updates] == [None] * (len(updates) - 1) + [str(version)]
    assert [b["flush_cache"] for b, _ in updates] == [False] * (len(updates) - 1) + [True]
    for path, _, replies in front.log[1 : len(front.log) - 1 - len(tail)]:
        for reply in replies:
            assert reply["before"]["paused"] and reply["before"]["running"] == 0, path
            assert reply.get("success", True), (path, reply)
    assert front.waited_for == 0  # the push never waited for a generation
    expected = bf16_digests(model)
    for state, digests in zip(engine.ask("state"), engine.ask("digests")):
        assert digests == expected  # bit for bit, every parameter, both ranks
        records = [r for r in state["version_records"] if r["version"] == str(version)]
        assert records == [{"version": str(version), "loaded": len(expected), "paused": True}]
        assert state["flushes"][-1] is True  # the last bucket's flush was accepted
        assert not state["session_open"] and state["waiting"] == IN_FLIGHT  # retracted, kept
    assert front.weight_version == str(version)
    # nothing left open: the learner's shm files are gone with its slots; its process groups too
    assert torch_shm_files() <= before_files
    if transport == "distributed":
        assert groups and all(g.pg is None for g in groups)
        # closing, the learner had SGLang's scheduler destroy the group on every TP rank
        name = front.log[2][1]["group_name"]
        assert front.log[-1][1] == {"group_name": name}
        assert all(reply["success"] for reply in front.log[-1][2]), front.log[-1][2]
        assert all(s["groups"] == [] for s in engine.ask("state"))


def test_in_place_is_refused_with_the_radix_cache_and_keeps_the_batch_without_it(
    engine, model, tmp_path
):
    """SGLang's flush needs an idle scheduler (flush_cache -> is_fully_idle): with requests paused
    in place it is refused, so a push asks for none when it pauses in place, which the learner
    allows only against --disable-radix-cache (no prefix cache to flush)."""
    _perturb(model)
    _requeue(engine)
    front = SGLangFront(engine.conns)
    with pytest.raises(PauseModeRefused, match="disable-radix-cache"):
        asyncio.run(_push(front, model, 3, tmp_path, transport="shm", pause_mode="in_place"))
    assert front.log == []
    front = SGLangFront(engine.conns, disable_radix_cache=True)
    result, _, _ = asyncio.run(
        _push(front, model, 3, tmp_path, transport="shm", pause_mode="in_place")
    )
    assert result.confirmed == (URL,), result.failed
    updates = front.updates()
    assert len(updates) >= 3 and front.log[0][1] == {"mode": "in_place"}
    assert [b["flush_cache"] for b, _ in updates] == [False] * len(updates)
    for _, replies in updates:
        for reply in replies:
            # paused in place: the running generations stay in the batch
            assert reply["before"]["paused"] and reply["before"]["running"] == IN_FLIGHT
    expected = bf16_digests(model)
    for state, digests in zip(engine.ask("state"), engine.ask("digests")):
        assert digests == expected
        assert [r for r in state["version_records"] if r["version"] == "3"] == [
            {"version": "3", "loaded": len(expected), "paused": True}
        ]
        assert state["running"] == IN_FLIGHT and not state["session_open"]


def test_off_waits_for_generations_and_samples_between_buckets_on_a_mix(engine, model, tmp_path):
    """Without a pause, SGLang's writer lock waits for every generation before each call, and
    between two bucket calls it admits new ones, which then run on some tensors of the new version
    and the rest of the old one, under the old label (the learner labels only the last bucket)."""
    _perturb(model)
    _requeue(engine)
    front = SGLangFront(engine.conns)
    front.admit_between_buckets = True
    result, _, _ = asyncio.run(_push(front, model, 4, tmp_path, transport="shm", pause_mode="off"))
    assert result.confirmed == (URL,), result.failed
    calls = [path for path, _, _ in front.log]
    assert "/pause_generation" not in calls and "/continue_generation" not in calls
    updates = front.updates()
    for _, replies in updates:
        assert all(not r["before"]["paused"] for r in replies)
    # IN_FLIGHT at the begin, then one admitted between every two bucket calls, each waited for
    assert front.waited_for == TP_SIZE * (IN_FLIGHT + len(updates) - 1)
    total = len(bf16_digests(model))
    assert front.admitted, "no generation was admitted between buckets"
    for loaded, label in front.admitted:
        assert 0 < loaded < total and label != "4"  # a mix, labelled with the old version
    for state, digests in zip(engine.ask("state"), engine.ask("digests")):
        assert digests == bf16_digests(model)
        assert [r for r in state["version_records"] if r["version"] == "4"] == [
            {"version": "4", "loaded": total, "paused": False}
        ]


def test_the_ranks_end_with_no_session_and_no_process_group(engine):
    byes = engine.close()
    assert byes == [{"open_groups": [], "session_open": False}] * TP_SIZE
