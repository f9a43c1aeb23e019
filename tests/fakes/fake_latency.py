"""FAKE engines and sandbox that only inject latency, for the control-plane benchmark (issue 35).

They replace the GPU inference engines and the sandbox hosts of a cluster, so that the shared
parts (Redis, rollout gateways, verifier, the learner's intake) can be loaded as a cluster of N
engines would load them, on a machine without N GPUs. They run no model and no command: every
answer waits a time drawn from a `LatencyProfile` (benchmarks/control_plane_profile.py takes it
from recorded measurements), then answers the same HTTP API as the real service.

* `FakeLatencyEngine` replaces one engine (`services/engine`, SGLang's `/generate`): at most
  `slots` requests at once (the engine's running batch; the others queue, as on SGLang), each
  answered after `generate_s` with `bash_ids` or, with probability `answer_probability`, one
  of `answer_ids` drawn uniformly (so an episode has 1 / answer_probability turns on average,
  and a right and a wrong answer give its group reward variance); log-prob -0.5 each,
  finish "stop", the engine's `weight_version`. `POST /update_weights_from_disk` sets
  `weight_version` only (SGLang's body; the learner's FakeWeightSync calls it).
* `FakeLatencySandbox` replaces the sandbox service: create (`create_s`), exec (`exec_s`, stdout
  of `stdout_chars` characters), and the calls the verifier makes (session info, kill, files,
  diff, delete: `control_s`).

    python -m tests.fakes.fake_latency engines --ports P1,P2,... --profile PROFILE.json
    python -m tests.fakes.fake_latency sandbox --port P --profile PROFILE.json

Many engines run in one process (one aiohttp server per port; the harness's machine has 2 cores,
so the fakes' own CPU is measured and reported apart). aiohttp rather than FastAPI: a fake's own
cost per request should be small next to what it simulates.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web


@dataclass(frozen=True)
class Distribution:
    """An empirical distribution of seconds: `bounds` ascending, `cumulative` the fraction of
    samples <= each bound (a Prometheus histogram's buckets); a draw is uniform within its bucket."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]

    def draw(self, rng: random.Random) -> float:
        u = rng.random()
        i = min(bisect.bisect_left(self.cumulative, u), len(self.bounds) - 1)
        lo = self.bounds[i - 1] if i else 0.0
        return rng.uniform(lo, self.bounds[i])

    def mean(self) -> float:
        prev_b = prev_c = 0.0
        total = 0.0
        for b, c in zip(self.bounds, self.cumulative):
            total += (c - prev_c) * (b + prev_b) / 2
            prev_b, prev_c = b, c
        return total

    @classmethod
    def from_json(cls, body: dict) -> Distribution:
        return cls(tuple(body["bounds"]), tuple(body["cumulative"]))


@dataclass(frozen=True)
class LatencyProfile:
    """What the fakes answer and how long they take (each field's source is in the profile file)."""

    generate_s: Distribution
    create_s: Distribution
    exec_s: Distribution
    control_s: float
    slots: int
    answer_probability: float
    bash_ids: list[int]
    answer_ids: list[list[int]]
    stdout_chars: int
    sources: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        body = json.loads(Path(path).read_text())
        dists = {k: Distribution.from_json(body[k]) for k in ("generate_s", "create_s", "exec_s")}
        rest = {k: v for k, v in body.items() if k not in dists}
        return cls(**dists, **rest)


class FakeLatencyEngine:
    """One simulated engine (module docstring)."""

    def __init__(self, profile: LatencyProfile, seed: int) -> None:
        self.profile, self.rng = profile, random.Random(seed)
        self.slots = asyncio.Semaphore(profile.slots)
        self.weight_version = "0"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/update_weights_from_disk", self.update_weights)
        app.router.add_get("/health", lambda _: web.Response())
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/model_info", self.readyz)
        return app

    async def generate(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        p = self.profile
        answer = self.rng.random() < p.answer_probability
        ids = self.rng.choice(p.answer_ids) if answer else p.bash_ids
        async with self.slots:
            version = self.weight_version
            await asyncio.sleep(p.generate_s.draw(self.rng))
        meta = {
            "id": body.get("rid", ""),
            "finish_reason": {"type": "stop", "matched": ids[-1]},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "weight_version": version,
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        }
        return web.json_response({"text": "", "output_ids": ids, "meta_info": meta})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "fake", "num_paused_requests": 0})

    async def readyz(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"service": "engine", "ready": True, "weight_version": self.weight_version}
        )


class FakeLatencySandbox:
    """The simulated sandbox fleet behind one URL (module docstring)."""

    def __init__(self, profile: LatencyProfile, seed: int) -> None:
        self.profile, self.rng = profile, random.Random(seed)
        self.ids = itertools.count()
        line = "-rw-r--r-- 1 agent agent 42 Dec  5 08:00 numbers.txt\n"
        self.stdout = (line * (profile.stdout_chars // len(line) + 1))[: profile.stdout_chars]

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_post("/v1/sessions", self.create)
        r.add_post("/v1/sessions/{sid}/exec", self.exec)
        r.add_get("/v1/sessions/{sid}", self.info)
        r.add_post("/v1/sessions/{sid}/kill", self.kill)
        r.add_get("/v1/sessions/{sid}/diff", self.diff)
        r.add_get("/v1/sessions/{sid}/files/{path}", self.file)
        r.add_delete("/v1/sessions/{sid}", self.delete)
        r.add_get("/readyz", self.readyz)
        return app

    def _session(self, sid: str) -> dict:
        return {"session_id": sid, "isolation": "fake", "workspace": "/workspace", "warm": False}

    async def create(self, _: web.Request) -> web.Response:
        await asyncio.sleep(self.profile.create_s.draw(self.rng))
        return web.json_response(self._session(f"fake-{next(self.ids)}"), status=201)

    async def exec(self, _: web.Request) -> web.Response:
        seconds = self.profile.exec_s.draw(self.rng)
        await asyncio.sleep(seconds)
        return web.json_response(
            {
                "stdout": self.stdout,
                "stderr": "",
                "exit_code": 0,
                "timed_out": False,
                "stdout_truncated_bytes": 0,
                "stderr_truncated_bytes": 0,
                "duration_ms": 1000 * seconds,
                "queue_ms": 0.0,
                "policy": {"verdict": "allow", "rule": None},
            }
        )

    async def _control(self) -> None:
        await asyncio.sleep(self.profile.control_s)

    async def info(self, request: web.Request) -> web.Response:
        await self._control()
        sid = request.match_info["sid"]
        return web.json_response({**self._session(sid), "commands": 2, "safety_events": []})

    async def kill(self, request: web.Request) -> web.Response:
        await self._control()
        sid = request.match_info["sid"]
        return web.json_response({"session_id": sid, "killed": True, "duration_ms": 0.0})

    async def diff(self, _: web.Request) -> web.Response:
        await self._control()
        return web.json_response({"changed": [], "count": 0, "truncated": False})

    async def file(self, _: web.Request) -> web.Response:
        await self._control()
        return web.Response(body=b"5\n")

    async def delete(self, request: web.Request) -> web.Response:
        await self._control()
        return web.json_response({"session_id": request.match_info["sid"], "deleted": True})

    async def readyz(self, _: web.Request) -> web.Response:
        return web.json_response({"ready": True, "service": "sandbox", "isolation": "fake"})


async def _serve(apps: list[tuple[web.Application, int]]) -> None:
    runners = []
    for app, port in apps:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        runners.append(runner)
    await asyncio.Event().wait()  # until the harness stops this process


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.fake_latency", description=__doc__.splitlines()[0]
    )
    parser.add_argument("kind", choices=("engines", "sandbox"))
    parser.add_argument("--ports", help="engines: comma-separated ports, one engine each")
    parser.add_argument("--port", type=int, help="sandbox: its port")
    parser.add_argument("--profile", required=True, help="a LatencyProfile JSON file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    profile = LatencyProfile.load(args.profile)
    if args.kind == "engines":
        ports = [int(p) for p in args.ports.split(",")]
        apps = [
            (FakeLatencyEngine(profile, args.seed + i).app(), port) for i, port in enumerate(ports)
        ]
    else:
        apps = [(FakeLatencySandbox(profile, args.seed).app(), args.port)]
    asyncio.run(_serve(apps))


if __name__ == "__main__":
    main()
