"""An engine that serves weights the learner cannot produce is refused (issue 30, bad input):
weight_dtype.refusal reads SGLang's /server_info fields (`dtype`, `quantization`,
`modelopt_quant`); WeightSync stops at its first push when an engine it starts with says so (one
error line naming the engine, what it reported and the settings that fix it; nothing sent to
the engine), keeps one met later out of rotation (refused in the sync hash, logged once, read
again at each probe until it serves a dtype the learner produces), and pushes in float32 to an
engine that does not say its dtype, said once."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from services.learner.weights.weight_dtype import DtypeRefused, refusal
from services.learner.weights.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.models import load_model

GOOD = "http://good.test:30000"
BAD = "http://bad.test:30000"
LOGGER = "services.learner.weights.weight_sync"


class ReportingSGLang:
    """FAKE SGLang 0.5.23 HTTP server (the fault: what its /server_info reports, per URL, set by
    the test): every weight route answers success and records the request; /model_info reports
    the last weight_version a request carried."""

    def __init__(self, infos: dict[str, dict]) -> None:
        self.infos = infos  # url -> extra /server_info fields (e.g. {"quantization": "fp8"})
        self.requests: list[tuple[str, str]] = []  # (url, path)
        self.version: dict[str, str] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        path = request.url.path
        self.requests.append((url, path))
        body = json.loads(request.content) if request.content else None
        if isinstance(body, dict) and body.get("weight_version") is not None:
            self.version[url] = body["weight_version"]
        if path == "/server_info":
            return httpx.Response(200, json={"version": "0.5.23", "tp_size": 1, **self.infos[url]})
        if path == "/model_info":
            return httpx.Response(200, json={"weight_version": self.version.get(url, "0")})
        if path == "/health":
            return httpx.Response(200)
        if path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={"message": "ok", "status": "ok"})
        if path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        return httpx.Response(
            200, json={"success": True, "message": "Success.", "num_paused_requests": 0}
        )

    def weight_calls(self, url: str) -> list[str]:
        """The weight routes called on `url`, but end_weight_update (reconcile closes a stale
        session before a full update: nothing is sent by it)."""
        return [
            p for u, p in self.requests if u == url and "weight" in p and p != "/end_weight_update"
        ]


def _sync(fake: ReportingSGLang, urls: list[str], tmp_path) -> WeightSync:
    client = EngineClient(urls, transport=httpx.MockTransport(fake), connect_retries=1)
    return WeightSync(
        client,
        None,
        transport="shm",
        deadline_s=10,
        sync_dir=tmp_path,
        retry_interval_s=0.1,
        share_parameters=False,  # streamed, so cast to the engines' dtype
    )


def test_a_dtype_or_quantization_the_learner_cannot_produce_is_refused_naming_the_fix():
    for info in (
        {"dtype": "int8"},
        {"dtype": "float8_e4m3fn"},
        {"dtype": "fp8"},
        {"dtype": "auto", "quantization": "fp8"},  # SGLang resolves it from a quantized checkpoint
        {"dtype": "half", "quantization": "awq"},
        {"dtype": "bfloat16", "modelopt_quant": "fp4"},
        {"dtype": "bfloat16", "torchao_config": "int8wo"},  # earlier SGLang releases
    ):
        reason = refusal(BAD, info)
        assert reason is not None, info
        reported = next(v for k, v in info.items() if k != "dtype" or len(info) == 1)
        assert BAD in reason and repr(reported) in reason, reason
        assert "--dtype bfloat16" in reason and "--quantization" in reason, reason
        assert "SHELLRL_DTYPE=bfloat16" in reason, reason
    for info in (
        {},
        {"dtype": None},
        {"dtype": "auto"},
        {"dtype": "half"},
        {"dtype": "float32", "quantization": None, "modelopt_quant": None},
        {"dtype": "bfloat16", "quantization": "unquant"},
    ):
        assert refusal(GOOD, info) is None, info


async def test_an_engine_the_learner_starts_with_that_serves_quantized_weights_stops_it(
    tmp_path, caplog
):
    fake = ReportingSGLang({GOOD: {"dtype": "bfloat16"}, BAD: {"quantization": "fp8"}})
    sync = _sync(fake, [GOOD, BAD], tmp_path)
    caplog.set_level(logging.ERROR, logger=LOGGER)
    try:
        with pytest.raises(DtypeRefused, match=r"bad\.test.*quantization 'fp8'"):
            await sync.push(load_model("tiny"), 0)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, errors  # one line: the engine, what it reported, the fix
        assert BAD in errors[0] and "'fp8'" in errors[0] and "--quantization" in errors[0]
        assert fake.weight_calls(BAD) == fake.weight_calls(GOOD) == []  # nothing sent
    finally:
        sync.close()
        await sync.client.close()


async def test_an_engine_met_later_that_serves_int8_stays_out_until_it_serves_bfloat16(
    tmp_path, caplog
):
    fake = ReportingSGLang({GOOD: {"dtype": "bfloat16"}, BAD: {"dtype": "int8"}})
    sync = _sync(fake, [GOOD], tmp_path)
    model = load_model("tiny")
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        assert (await sync.push(model, 1)).confirmed == (GOOD,)
        assert sync.push_dtype == "bfloat16"
        # BAD joins as engine_membership admits a registered engine: out of rotation, then the
        # next reconcile gives it a full update (here: after reconcile's health probe)
        sync.engines[BAD] = type(sync.engines[GOOD])(BAD, in_rotation=False)
        sync.client.add_url(BAD, available=False)

        async def reconcile_until(condition, version: int) -> None:
            deadline = time.monotonic() + 15
            while not condition() and time.monotonic() < deadline:
                await sync.reconcile(model, version)
                await asyncio.sleep(0.05)  # the background health probe runs meanwhile
            assert condition()

        def read_twice() -> bool:
            return sum(u == BAD and p == "/server_info" for u, p in fake.requests) >= 2

        await reconcile_until(read_twice, 1)  # probed, refused, probed and refused again
        state = sync.engines[BAD]
        assert not state.in_rotation and state.refused and "'int8'" in state.refused
        assert fake.weight_calls(BAD) == []  # never pushed to
        assert sync.engines[GOOD].in_rotation and sync.published_version is None  # no Redis
        assert sync.status()["engines"][1]["refused"] == state.refused  # the sync hash's entry
        refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert refusals == [state.refused]  # logged once, not at every probe
        announced = [r for r in caplog.records if BAD in getattr(r, "engines", ())]
        assert len(announced) == 1  # "sending a full update" at first contact only, not per probe

        fake.infos[BAD] = {"dtype": "bfloat16"}  # restarted with a dtype the learner produces
        await reconcile_until(lambda: sync.engines[BAD].in_rotation, 1)
        assert sync.engines[BAD].version == "1" and sync.engines[BAD].refused is None
        assert "/update_weights_from_tensor" in fake.weight_calls(BAD)
    finally:
        sync.close()
        await sync.client.close()


async def test_an_engine_that_does_not_say_its_dtype_gets_float32_said_once(tmp_path, caplog):
    fake = ReportingSGLang({GOOD: {"dtype": "bfloat16"}, BAD: {}})
    sync = _sync(fake, [GOOD, BAD], tmp_path)
    model = load_model("tiny")
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        for version in (1, 2):
            assert set((await sync.push(model, version)).confirmed) == {GOOD, BAD}
        assert sync.push_dtype == "float32"
        said = [r for r in caplog.records if r.getMessage() == "weight pushes travel in this dtype"]
        assert len(said) == 1 and said[0].dtype == "float32" and BAD in said[0].reason
        assert sync.engines[BAD].refused is None
    finally:
        sync.close()
        await sync.client.close()
