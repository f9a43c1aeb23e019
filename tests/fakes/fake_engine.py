"""FAKE engines for the rollout tests and benchmark, used only where a fault or delay must be injected.

* `ScriptedEngine` replaces the inference engine (`services/engine`, SGLang's `/generate`) with
  replies chosen by a script: malformed model outputs (two commands, unclosed tags...) that a
  real model cannot be made to produce on demand, a word split into non-canonical tokens (C01),
  a broken engine's log-probs (NaN, inf, > 0), zero-latency replies (gateway overhead
  benchmark), or a long-tail delay per episode.
* `DelayedEngine` replaces the engine CLIENT (`shellrl.clients.engine.EngineClient.generate`) in
  process: a fixed reply after a delay chosen per request id, tagged with the `version` it holds
  at the start of the request (the long-tail benchmark's episodes of 10 s and 80 s).
* `RecordingProxy` is not a fake model: it forwards every call to a REAL engine unchanged and
  records the `/generate` request bodies and responses, so a test can compare what the engine
  received and returned with what the trajectory stores; it can also hold requests (`hold`)
  to time a fault exactly.

`ScriptedEngine` and `RecordingProxy` speak SGLang's HTTP API and shellrl's readiness probe
(`/readyz`, what `shellrl.service.main.wait_until_ready` waits for), so the gateway uses its real
`EngineClient` against them. tests/unit/test_fakes_match_services.py checks ScriptedEngine's
routes against the real engine's and DelayedEngine's `generate` against EngineClient's.
`serve_in_thread(app)` runs an ASGI app on a free port in a background thread.
`python -m tests.fakes.fake_engine --port P --reply TEXT` runs a zero-latency ScriptedEngine
as its own process (benchmarks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shellrl.clients.engine_responses import GenerateResult


@dataclass
class Reply:
    """What the fake returns for one /generate: ids with their log-probs, finish reason, version."""

    output_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str = "stop"  # stop | length | abort
    weight_version: str = "0"
    delay_s: float = 0.0
    matched: int | str | None = None

    def body(self, rid: str, prompt_tokens: int) -> dict:
        logprobs = self.logprobs if self.logprobs is not None else [-0.5] * len(self.output_ids)
        finish = {"type": self.finish_reason}
        if self.finish_reason == "stop":
            finish["matched"] = self.matched
        elif self.finish_reason == "length":
            finish["length"] = len(self.output_ids)
        else:
            finish["message"] = "Aborted"
        return {
            "text": "",
            "output_ids": self.output_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(self.output_ids),
                "weight_version": self.weight_version,
                "cached_tokens": 0,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(logprobs, self.output_ids)
                ],
            },
        }


Script = Callable[[dict], Reply]


@dataclass
class ScriptedEngine:
    """FAKE `/generate`: `script(request_body) -> Reply`. Records every request body."""

    script: Script
    requests: list[dict] = field(default_factory=list)
    weight_version: str = "0"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            reply = self.script(body)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            # json.dumps, not JSONResponse: a scripted NaN / inf log-prob goes out as the
            # `NaN` / `Infinity` literal a broken engine would send (JSONResponse refuses them)
            content = json.dumps(reply.body(body.get("rid", ""), len(body["input_ids"])))
            return Response(content, media_type="application/json")

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)  # SGLang's: an empty body

        @app.get("/readyz")
        async def readyz() -> dict:
            return {"service": "engine", "ready": True, "weight_version": self.weight_version}

        @app.get("/model_info")
        async def model_info() -> dict:
            return {"model_path": "fake", "weight_version": self.weight_version}

        return app


class DelayedEngine:
    """In-process FAKE of `EngineClient.generate`: every request answers `reply_ids` (log-prob -0.1
    each, finish "stop") after `delay_s(rid)` seconds, with the `version` held when it started.
    `busy_s`: (start, end) monotonic seconds of every finished request."""

    def __init__(self, reply_ids: list[int], delay_s: Callable[[str], float]) -> None:
        self.reply_ids, self.delay_s = list(reply_ids), delay_s
        self.version = 0
        self.busy_s: list[tuple[float, float]] = []

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        url: str | None = None,
        avoid: Iterable[str] = (),
    ) -> GenerateResult:
        version, start = self.version, time.monotonic()
        await asyncio.sleep(self.delay_s(rid or ""))
        self.busy_s.append((start, time.monotonic()))
        ids = list(self.reply_ids)
        return GenerateResult(
            output_ids=ids,
            output_logprobs=[-0.1] * len(ids) if return_logprob else [],
            finish_reason="stop",
            matched_stop=ids[-1],
            weight_version=str(version),
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            text="",
            engine_url=url or "fake",
            rid=rid or "",
        )


class RecordingProxy:
    """Pass-through to a REAL engine that records each /generate (request, response).

    `hold_call(n)` makes the n-th /generate call (0-based) wait at the proxy, before it reaches the
    engine, until `release()`; `held` is set while it waits (a fault, e.g. a weight update, can be
    timed exactly between two requests). `in_flight` counts calls inside the proxy.
    `sampling_overrides` are merged into every /generate's sampling_params on the way to the engine
    (e.g. a `sampling_seed`, so that a timing test does not depend on where sampling stops); the
    recorded request is the agent's own.
    """

    def __init__(self, target_url: str) -> None:
        self.target_url = target_url.rstrip("/")
        self.calls: list[tuple[dict, dict | None]] = []
        self.in_flight = 0
        self.hold_index: int | None = None
        self.held = threading.Event()
        self._released = threading.Event()
        self.sampling_overrides: dict = {}

    def hold_call(self, index: int) -> None:
        self.hold_index, self.held = index, threading.Event()
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def app(self) -> FastAPI:
        app = FastAPI()
        client = httpx.AsyncClient(timeout=600.0)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request):
            body = await request.body()
            record = None
            if path == "generate":
                record = (await request.json(), None)
                self.calls.append(record)
                self.in_flight += 1
                if len(self.calls) - 1 == self.hold_index:
                    self.held.set()
                    while not self._released.is_set():
                        await asyncio.sleep(0.005)
                if self.sampling_overrides:
                    sent = dict(record[0])
                    sent["sampling_params"] = {
                        **(sent.get("sampling_params") or {}),
                        **self.sampling_overrides,
                    }
                    body = json.dumps(sent).encode()
            try:
                response = await client.request(
                    request.method,
                    f"{self.target_url}/{path}",
                    content=body,
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError as exc:
                return JSONResponse({"error": {"message": f"proxy: {exc}"}}, status_code=502)
            finally:
                if record is not None:
                    self.in_flight -= 1
            if record is not None and response.status_code == 200:
                self.calls[self.calls.index(record)] = (record[0], response.json())
            return JSONResponse(
                response.json() if response.content else None, status_code=response.status_code
            )

        return app

    def generate_calls(self) -> list[tuple[dict, dict | None]]:
        return list(self.calls)


class ThreadServer:
    """An ASGI app served by uvicorn on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app, port: int = 0) -> None:
        from tests.helpers.redis_server import free_port

        self.port = port or free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_in_thread(app) -> ThreadServer:
    return ThreadServer(app).start()


def fixed_reply(ids: list[int], *, eot_id: int, delay_s: float = 0.0) -> Script:
    """Every request gets the same reply ids (plus the end-of-turn token), after `delay_s`."""

    def script(_: dict) -> Reply:
        return Reply(list(ids) + [eot_id], delay_s=delay_s, matched=eot_id)

    return script


def main(argv: list[str] | None = None) -> None:
    """A zero-latency (or fixed-delay) FAKE engine process: every reply is `--reply` + end-of-turn
    (tokenized with `--model-path`'s tokenizer), or `--reply-ids` + `--end-of-turn-id` as given
    (no tokenizer loaded: a faster start)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.fake_engine", description=main.__doc__
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reply", default="<bash>true</bash>")
    parser.add_argument("--model-path", default="tiny")
    parser.add_argument("--reply-ids", help="comma-separated token ids (instead of --reply)")
    parser.add_argument("--end-of-turn-id", type=int, help="with --reply-ids")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.reply_ids:
        ids, eot_id = [int(i) for i in args.reply_ids.split(",")], args.end_of_turn_id
    else:
        from services.rollout.prompt import ChatFormat, load_chat_tokenizer

        chat = ChatFormat.from_tokenizer(load_chat_tokenizer(args.model_path))
        ids = chat.tokenizer(args.reply, add_special_tokens=False)["input_ids"]
        eot_id = chat.end_of_turn_id
    engine = ScriptedEngine(fixed_reply(ids, eot_id=eot_id, delay_s=args.delay_ms / 1000))
    engine.requests = _Discard()
    uvicorn.run(
        engine.app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )


class _Discard(list):
    def append(self, _) -> None:  # a long benchmark keeps no request bodies
        pass


if __name__ == "__main__":
    main()
