"""The egress audit log: every verdict of the proxy as one entry of the Redis stream
`shellrl:egress` (`shellrl.streams.keys.STREAM_EGRESS`), approximately capped at `maxlen`.

Entry fields (all strings): `session_id`, `time` (unix seconds), `phase` (`decision`: the verdict,
before anything is forwarded; `closed`: an allowed exchange ended, with its byte counts), `method`,
`host`, `port`, `path` (at most 2,000 characters; "" for CONNECT; all three empty when no request
could be read), `verdict` (`allow`; `deny`: a request was read and a rule or a limit refused it;
`refused`: the proxy could not or would not read one: malformed, ambiguous, too large, too slow,
cut short, past the session's open connections), `rule` ("" when none), `reason`, `bytes_sent`
(client to upstream), `bytes_received`. Every connection to the proxy gets exactly one
`decision` entry.

The decision entry of an allowed request is written before the request is forwarded: when Redis
cannot take it, the proxy refuses the request (fail closed: no unaudited egress).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from shellrl.streams.connection import connect
from shellrl.streams.keys import STREAM_EGRESS

log = logging.getLogger(__name__)
MAX_PATH_CHARS = 2000


@dataclass(frozen=True)
class EgressRecord:
    session_id: str
    phase: str
    method: str
    host: str
    port: int
    path: str
    verdict: str
    rule: str | None
    reason: str
    bytes_sent: int = 0
    bytes_received: int = 0
    time: float = 0.0

    def fields(self) -> dict[str, str]:
        out = {k: "" if v is None else str(v) for k, v in asdict(self).items()}
        out["path"] = out["path"][:MAX_PATH_CHARS]
        out["time"] = f"{self.time or time.time():.6f}"
        return out


class AuditLog:
    """Appends `EgressRecord`s to the audit stream of the Redis at `redis_url` (connected on first
    use). `append` raises redis / OSError on failure; the caller decides (fail closed)."""

    def __init__(self, redis_url: str, maxlen: int = 1_000_000, timeout_s: float = 2.0) -> None:
        self.redis_url, self.maxlen, self.timeout_s = redis_url, maxlen, timeout_s
        self._redis = None

    async def append(self, record: EgressRecord) -> None:
        if self._redis is None:
            self._redis = connect(
                self.redis_url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
            )
        await self._redis.xadd(STREAM_EGRESS, record.fields(), maxlen=self.maxlen, approximate=True)

    async def close(self) -> None:
        if self._redis is not None:
            redis, self._redis = self._redis, None
            await redis.aclose()
