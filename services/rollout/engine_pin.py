"""One engine per episode, and what happens when it fails (agent_loop.py makes one `EnginePin` per
episode and sends every request through it).

Pinning: the first request of an episode goes to the least-loaded routable engine (the engine
client's routing; engine_directory.py decides what is routable) and every later request to the
same engine, so that engine's prefix cache holds the episode's history and each turn prefills
only its new tokens. `pinned=False` routes every request by load alone (a baseline for
benchmarks/bench_engine_fleet.py).

When the pinned engine fails mid-episode (no connection, no answer in time, the connection lost,
draining for SIGTERM, gone from the registry or out of the learner's rotation: `EngineUnavailable`
and its kinds `EngineNotRoutable`; or an answer sampled with weights below the staleness floor:
`StaleEngine`, discarded whole), the episode CONTINUES on another engine from its exact token
prefix. The failed request's tokens were never appended, so the next request sends the same input
ids to the least-loaded other engine (the failed one only if no other is routable); token-in /
token-out makes this exact, and the new engine's ACTION segments carry its own policy version,
as after a weight update (DESIGN.md section 4, rule 4). The lost request is re-sampled; since the
failure does not depend on what it would have sampled, this keeps the sampling unbiased.

Chosen over ending the episode as an INFRA_ENGINE failure and re-running it because the
continuation is exact and cheaper: the turns already sampled, the sandbox state and the group's
wait are kept. Bounded: at most `max_failovers` moves per episode; one more failure raises, and
the agent loop ends the episode as FAILURE_INFRA_ENGINE (re-run by the worker). Bad input (HTTP
4xx) and answers that break the contract (`EngineError`) never move: they end the episode.
"""

from __future__ import annotations

import logging

from services.rollout import metrics as m
from shellrl.clients.engine_responses import EngineUnavailable, GenerateResult
from shellrl.clients.engine_routing import EngineNotRoutable, StaleEngine

log = logging.getLogger(__name__)


class EnginePin:
    """The engine of one episode (None until its first answer) and the moves it made so far.
    engine: an `EngineClient` (or anything with its `generate`)."""

    def __init__(self, engine, *, pinned: bool = True, max_failovers: int = 2) -> None:
        self.engine, self.pinned, self.max_failovers = engine, pinned, max_failovers
        self.url: str | None = None
        self.failovers = 0

    async def generate(
        self, input_ids: list[int], params: dict, rid: str
    ) -> tuple[GenerateResult, str]:
        """One request on the episode's engine, moved to another engine when it fails (module
        docstring). A moved request's rid gets the suffix `-f<n>`. Returns the answer and the rid
        it was sent with. Raises EngineUnavailable once out of moves, EngineError at once."""
        avoid: list[str] = []
        while True:
            sent = f"{rid}-f{self.failovers}" if self.failovers else rid
            route = {"url": self.url} if self.url else {"avoid": avoid} if avoid else {}
            try:
                result = await self.engine.generate(
                    input_ids, params, return_logprob=True, rid=sent, **route
                )
            except EngineUnavailable as exc:
                if self.failovers >= self.max_failovers:
                    raise
                reason = failover_reason(exc)
                m.ENGINE_FAILOVERS.labels(reason).inc()
                log.warning(
                    "engine failed mid-episode; continuing on another engine from the same tokens",
                    extra={"engine": exc.url, "reason": reason, "detail": str(exc)[:300]},
                )
                self.url, self.failovers, avoid = None, self.failovers + 1, [exc.url]
                continue
            if self.pinned:
                self.url = result.engine_url
            return result, sent


def failover_reason(exc: EngineUnavailable) -> str:
    """The metric label of a move: stale, not_routable or unreachable."""
    if isinstance(exc, StaleEngine):
        return "stale"
    if isinstance(exc, EngineNotRoutable):
        return "not_routable"
    return "unreachable"
