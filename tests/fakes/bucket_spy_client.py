"""An `EngineClient` that reads the engine's weight_version back after every bucket of a push.

Replaces: shellrl.clients.engine.EngineClient in tests of streamed pushes (the real client, one
extra GET after each `update_weights_from_tensor`). `after_bucket`: (url, the version label the
bucket carried, the version the engine reported once the bucket's call returned), in order."""

from __future__ import annotations

from shellrl.clients.engine import EngineClient


class BucketSpyClient(EngineClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after_bucket: list[tuple[str, str | None, str | None]] = []

    async def update_weights_from_tensor(self, serialized_named_tensors, **kwargs):
        answer = await super().update_weights_from_tensor(serialized_named_tensors, **kwargs)
        for url in kwargs.get("urls") or self.urls:
            reported = (await self.get_weight_version(urls=[url]))[url]
            self.after_bucket.append((url, kwargs.get("weight_version"), reported))
        return answer
