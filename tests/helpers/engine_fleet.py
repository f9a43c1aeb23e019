"""Several engines with the registry: real engine processes that register themselves, the learner's
engine side (WeightSync + EngineMembership, in process, one loop as in the learner's worker) and
the gateway's (EngineClient + EngineDirectory + PolicyVersionWatcher), for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.learner.weights.engine_membership import EngineMembership
from services.learner.weights.weight_sync import WeightSync
from services.rollout.engine_directory import EngineDirectory
from services.rollout.engine_pin import EnginePin
from services.rollout.policy_version import PolicyVersionWatcher
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_registry import model_fingerprint, model_summary
from shellrl.clients.engine_routing import weight_version_number
from shellrl.models import resolve_model_path
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port


def registering_engine(
    redis_url: str, log_dir: Path, model_path: str = "tiny", port: int = 0, **env: str
) -> ServiceProcess:
    """An engine process (not started) that registers itself in shellrl:engines at `redis_url`,
    heartbeating every 0.3 s (live 0.9 s after its last beat)."""
    port = port or free_port()
    settings = {
        "SHELLRL_MODEL_PATH": model_path,
        "SHELLRL_LOG_LEVEL": "WARNING",
        "SHELLRL_NUM_THREADS": "1",
        "SHELLRL_REDIS_URL": redis_url,
        "SHELLRL_REGISTER_URL": f"http://127.0.0.1:{port}",
        "SHELLRL_REGISTER_HEARTBEAT_S": "0.3",
        **env,
    }
    return ServiceProcess("engine", port, settings, log_dir)


class LearnerSide:
    """The learner's engine side in one task, as the learner's loop runs it: `reconcile` every
    `tick_s` (the learner: every read of its stream, block_ms 1000 when idle), and a push of the
    next version whenever `step()` asks for one. refresh_s: the registry's (learner default 1)."""

    def __init__(
        self,
        redis_url: str,
        sync_dir: Path,
        seeds: list[str] = (),
        model_path: str = "tiny",
        *,
        refresh_s: float = 0.2,
        tick_s: float = 0.1,
    ):
        self.model_path, self.model = model_path, None  # loaded by `run`
        self.redis = streams.connect(redis_url)
        self.client = EngineClient(list(seeds), timeout_s=30, connect_retries=1, allow_empty=True)
        self.sync = WeightSync(
            self.client,
            self.redis,
            transport="shm",
            deadline_s=30,
            sync_dir=sync_dir,
            retry_interval_s=0.5,
            # unpaused: a push waits for the generations in flight, so that none spans two of the
            # back-to-back versions these tests publish (paused in place, the default for
            # shellrl's engine, a generation may span them and be discarded as stale by design,
            # which is not what the routing checks here are about)
            pause_mode="off",
        )
        config = json.loads((resolve_model_path(model_path) / "config.json").read_text())
        self.sync.membership = EngineMembership(
            self.redis,
            self.sync,
            model=model_path,
            fingerprint=model_fingerprint(config),
            summary=model_summary(config),
            refresh_s=refresh_s,
        )
        self.version = 0
        self.tick_s = tick_s
        self._steps: asyncio.Queue[asyncio.Future] = asyncio.Queue()

    async def step(self) -> int:
        """One more version pushed (and published once every engine in rotation has it)."""
        done = asyncio.get_running_loop().create_future()
        await self._steps.put(done)
        return await done

    async def run(self, stop: asyncio.Event) -> None:
        import torch

        from shellrl.models import load_model

        self.model = await asyncio.to_thread(load_model, self.model_path, dtype=torch.float32)
        await self.sync.push(self.model, self.version)
        while not stop.is_set():
            await self.sync.reconcile(self.model, self.version)
            try:
                done = await asyncio.wait_for(self._steps.get(), self.tick_s)
            except TimeoutError:
                continue
            self.version += 1
            await self.sync.push(self.model, self.version)
            done.set_result(self.version)

    async def close(self) -> None:
        self.sync.close()
        await self.client.close()
        await self.redis.aclose()


class GatewaySide:
    """The gateway's engine side: client, directory and version watcher (max_staleness 1)."""

    def __init__(
        self,
        redis_url: str,
        seeds: list[str] = (),
        max_staleness: int = 1,
        *,
        refresh_s: float = 0.1,
    ) -> None:
        self.redis = streams.connect(redis_url)
        self.client = EngineClient(list(seeds), timeout_s=60, route_wait_s=60, allow_empty=True)
        self.watcher = PolicyVersionWatcher(self.redis, poll_s=0.1)
        self.directory = EngineDirectory(
            self.redis,
            self.client,
            seeds,
            current_version=lambda: self.watcher.version,
            max_staleness=max_staleness,
            refresh_s=refresh_s,
        )
        self.max_staleness = max_staleness

    def current(self) -> int:
        return self.watcher.version

    async def close(self) -> None:
        await self.client.close()
        await self.redis.aclose()


@dataclass
class Answer:
    """One /generate answer an episode kept: engine, version sampled with, the published version
    when it arrived, prompt and cached tokens, latency (s)."""

    engine: str
    version: int
    current: int
    prompt_tokens: int
    cached_tokens: int
    latency_s: float


@dataclass
class Episode:
    answers: list[Answer] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)


async def run_episode(
    gateway: GatewaySide,
    prompt: list[int],
    turns: int,
    name: str,
    *,
    pinned: bool = True,
    observation: tuple[int, ...] = (198, 1061, 30, 198),
    max_new_tokens: int | Callable[[], int] = 6,
    sink: list[Answer] | None = None,
    exec_s: Callable[[], float] | None = None,
) -> Episode:
    """A token-in/token-out episode of `turns` requests through `EnginePin` (the agent loop's
    engine choice), a fixed observation appended after each answer. sink: where each answer is
    also appended as it arrives. exec_s: seconds to wait after each answer (a command's run).
    max_new_tokens: tokens per turn, or a draw per turn (a stop string at varying places)."""
    pin = EnginePin(gateway.client, pinned=pinned, max_failovers=4)
    episode = Episode(input_ids=list(prompt))
    for turn in range(turns):
        new = max_new_tokens() if callable(max_new_tokens) else max_new_tokens
        params = {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True}
        start = time.monotonic()
        result, _ = await pin.generate(list(episode.input_ids), params, f"{name}-t{turn}")
        version = weight_version_number(result.weight_version)
        answer = Answer(
            result.engine_url,
            -1 if version is None else version,
            gateway.current(),
            result.prompt_tokens,
            result.cached_tokens,
            time.monotonic() - start,
        )
        episode.answers.append(answer)
        if sink is not None:
            sink.append(answer)
        episode.input_ids += result.output_ids + list(observation)
        if exec_s is not None:
            await asyncio.sleep(exec_s())
    return episode
