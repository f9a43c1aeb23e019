"""The engine's entry in the registry `shellrl:engines` (shellrl.clients.engine_registry): written
once the engine serves, again every `heartbeat_s` (live for HEARTBEATS_LIVE of them), with
`leaving` once it drains (SIGTERM), deleted at exit. The learner gives a newly registered (or
restarted: new `instance`) engine a full weight push of the current version before the gateway
routes to it; when the learner refuses it (another model) the engine's log says so, once.

Inside shellrl's engine (`SHELLRL_REGISTER_URL` set) `start_registrar` runs it in the app's
lifespan. Beside an SGLang server the same registrar runs as a sidecar process, which reads the
engine's /health every heartbeat (not answering: no heartbeat; answering again: a new instance,
since a restarted SGLang serves its initial weights):

    python -m services.engine.registration --engine-url http://10.0.0.5:30000 --model-path DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import uuid
from collections.abc import Awaitable, Callable, Mapping

import httpx
import redis.asyncio as aioredis

from shellrl import streams
from shellrl.clients.engine_registry import (
    EngineRegistration,
    delete_registration,
    model_fingerprint,
    model_summary,
    write_registration,
)
from shellrl.streams.keys import ENGINE_SYNC_KEY

log = logging.getLogger(__name__)

HEARTBEATS_LIVE = 3  # a registration is live for this many heartbeats after its last write
NOT_SERVING_POLL_S = 0.2  # while the engine does not serve yet, its state is read this often


class EngineRegistrar:
    """Registers `url` while `state()` says "up" or "leaving" (see the module docstring).
    state: async () -> "up" | "leaving" | "down"; config: the model's Hugging Face config dict."""

    def __init__(
        self,
        redis: aioredis.Redis,
        url: str,
        model: str,
        config: Mapping,
        *,
        heartbeat_s: float,
        state: Callable[[], Awaitable[str]],
    ) -> None:
        self.redis, self.url, self.heartbeat_s, self.state = (
            redis,
            url.rstrip("/"),
            heartbeat_s,
            state,
        )
        self.model, self.fingerprint = model, model_fingerprint(config)
        self.summary = model_summary(config)
        self.instance: str | None = None
        self._refusal_logged: str | None = None

    async def run(self) -> None:
        """Heartbeat until cancelled; Redis errors are logged and retried at the next beat."""
        while True:
            try:
                await self.beat()
            except Exception as exc:  # Redis away: the entry lapses after its ttl, not the engine
                log.warning("engine registration failed", extra={"error": str(exc)})
            # registered: a heartbeat; not (yet) serving: look again soon, so that the learner
            # hears of it (and gives it the current weights) right after it is ready
            serving = self.instance is not None
            await asyncio.sleep(self.heartbeat_s if serving else NOT_SERVING_POLL_S)

    async def beat(self) -> None:
        """One heartbeat: write (or let lapse) the registration, then look for a refusal."""
        state = await self.state()
        if state == "down":
            self.instance = None  # serving again later is a new instance
            return
        if self.instance is None:
            self.instance = uuid.uuid4().hex[:12]
            log.info("registering in shellrl:engines", extra=self._fields())
        await write_registration(
            self.redis,
            EngineRegistration(
                url=self.url,
                model=self.model,
                fingerprint=self.fingerprint,
                instance=self.instance,
                summary=self.summary,
                ttl_s=HEARTBEATS_LIVE * self.heartbeat_s,
                leaving=state == "leaving",
            ),
        )
        raw = await self.redis.hget(ENGINE_SYNC_KEY, self.url)
        refused = json.loads(raw).get("refused") if raw else None
        if refused and refused != self._refusal_logged:
            log.error("the learner refused this engine: %s", refused, extra=self._fields())
        self._refusal_logged = refused

    async def close(self) -> None:
        """Delete this instance's registration (bounded; errors logged)."""
        if self.instance is None:
            return
        try:
            await asyncio.wait_for(delete_registration(self.redis, self.url, self.instance), 5.0)
        except Exception as exc:  # shutting down: Redis away or slow; the entry lapses (ttl)
            log.warning("could not delete the registration", extra={"error": str(exc)})

    def _fields(self) -> dict:
        return {"engine": self.url, "instance": self.instance, "model": self.model}


async def http_state(url: str, path: str, headers: dict | None = None) -> str:
    """ "up" when GET url+path answers 200 within 5 s, else "down"."""
    try:
        async with httpx.AsyncClient(timeout=5.0, headers=headers) as http:
            return "up" if (await http.get(url.rstrip("/") + path)).status_code == 200 else "down"
    except httpx.HTTPError:
        return "down"


@contextlib.asynccontextmanager
async def registered(runtime):
    """In the engine's lifespan: registers it while it serves when `register_url` is set (the
    state comes from its own /readyz, "leaving" once it drains). Yields the registrar or None."""
    settings = runtime.settings
    if not settings.register_url:
        yield None
        return
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    local = f"http://{host}:{settings.listen_port}"

    async def state() -> str:
        return "leaving" if runtime.draining else await http_state(local, "/readyz")

    redis = streams.connect(settings.redis_url)
    registrar = EngineRegistrar(
        redis,
        settings.register_url,
        settings.served_model_name or settings.model_path,
        runtime.model.config.to_dict(),
        heartbeat_s=settings.register_heartbeat_s,
        state=state,
    )
    task = asyncio.create_task(registrar.run(), name="engine-registration")
    try:
        yield registrar
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await registrar.close()
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    """The sidecar beside an SGLang server (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m services.engine.registration")
    parser.add_argument("--engine-url", required=True, help="where others reach the engine")
    parser.add_argument("--model-path", required=True, help="the engine's HF model directory")
    parser.add_argument("--model-name", help="name to report (default: --model-path)")
    parser.add_argument("--redis-url", default=os.environ.get("SHELLRL_REDIS_URL"))
    parser.add_argument("--heartbeat-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    from shellrl.models import resolve_model_path

    config = json.loads((resolve_model_path(args.model_path) / "config.json").read_text())
    token = os.environ.get("SHELLRL_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    logging.basicConfig(level=logging.INFO)

    async def sidecar() -> None:
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, asyncio.current_task().cancel
        )  # SIGTERM (a pod going away): delete the registration on the way out
        redis = streams.connect(args.redis_url or "redis://127.0.0.1:6379/0")
        registrar = EngineRegistrar(
            redis,
            args.engine_url,
            args.model_name or args.model_path,
            config,
            heartbeat_s=args.heartbeat_s,
            state=lambda: http_state(args.engine_url, "/health", headers),
        )
        try:
            await registrar.run()
        finally:
            await registrar.close()
            await redis.aclose()

    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(sidecar())


if __name__ == "__main__":
    main()
