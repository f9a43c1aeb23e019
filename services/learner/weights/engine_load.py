"""One engine's weight load: the pause around it (load_paused), the transfer of a prepared version
(bucket_send.py: SGLang's tensor envelope or a gloo/NCCL broadcast; or a safetensors directory),
the session end that swaps it in, and the read back of its weight_version. WeightSync
(weight_sync.py) runs it per engine under the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_result, wait_fixed

from services.learner.weights.bucket_send import transfer
from services.learner.weights.engine_groups import EngineGroups
from services.learner.weights.engine_rotation import bounded
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError, EngineUnavailable

CLOSE_TIMEOUT_S = 5.0  # the session's end after an interrupted transfer
VERIFY_POLL_S = 0.01  # how often an engine's weight_version is read until it reports the new one


async def load_paused(
    client: EngineClient,
    url: str,
    mode: str,
    atomic: bool,
    load: Callable[[asyncio.Future | None], Awaitable[dict[str, float]]],
) -> dict[str, float]:
    """`load(paused)` (a load_engine call) between the engine's pause_generation(`mode`) and
    continue_generation. SGLang loads each bucket as it comes, so every bucket waits for the pause
    (paused=None). An `atomic` engine (shellrl's) only stages buckets until the session's end, off
    its scheduler thread, so its pause (answered once its current step ended) runs beside the
    transfer and only the end waits for it (paused=the pause's future): the step's wait and the
    copy overlap. The continue is sent whatever happened, after a pause still in flight landed
    (bounded by CLOSE_TIMEOUT_S), so the engine is never left paused. Returns load's phases plus
    pause (from sending it to its answer) and continue (its round trip), seconds."""
    start = time.perf_counter()
    answered: list[float] = []
    pausing = asyncio.ensure_future(client.pause_generation(mode, urls=[url]))
    pausing.add_done_callback(lambda _: answered.append(time.perf_counter()))
    pausing.add_done_callback(lambda t: t.cancelled() or t.exception())  # raised where awaited
    try:
        if not atomic:
            await pausing
        phases = await load(pausing if atomic else None)
    finally:
        await asyncio.wait({pausing}, timeout=CLOSE_TIMEOUT_S)
        t1 = time.perf_counter()
        await client.continue_generation(urls=[url])
    pause_s = (answered[0] if answered else t1) - start
    return {"pause": pause_s, **phases, "continue": time.perf_counter() - t1}


async def load_engine(
    client: EngineClient,
    groups: EngineGroups | None,
    url: str,
    prepared: dict,
    version: int,
    begin: asyncio.Future | None,
    tp_size_of: Callable[[], Awaitable[int]],
    flush: bool = True,
    atomic: bool = False,
    paused: asyncio.Future | None = None,
) -> dict[str, float]:
    """Load `prepared` (WeightStaging.prepare's output) into the engine at `url` as `version` and
    wait until it reports it. begin: its begin_weight_update, already sent (None: sent here);
    tp_size_of: its TP size (one serialized entry per rank), asked after begin; flush: the last
    bucket (or the disk load) asks the engine to flush its cache (False for a push paused in
    place: SGLang refuses a flush while requests sit in its running batch). Returns phase
    seconds: transfer, load (session end: the engine swaps the weights in), verify. Raises the
    client's EngineError / EngineUnavailable; the caller's deadline bounds the whole call.
    Interrupted during the transfer (cancelled: the deadline, the learner's shutdown; or a bucket
    that could not be made), it closes the session (within CLOSE_TIMEOUT_S) before the exception
    goes on: `atomic` (shellrl's engine, which stages buckets until the end) discards what was
    staged, so the engine keeps serving its version; SGLang loaded each bucket as it came (its
    end only closes the session). paused: the engine's pause_generation, sent beside the transfer
    (an atomic engine stages buckets while it still generates): awaited before the session's end,
    so the swap happens paused; its error (EngineError) closes the session like a bucket's."""
    phases, urls, weight_version = {}, [url], str(version)
    t0 = time.perf_counter()
    if "model_path" in prepared:
        await client.update_weights_from_disk(
            prepared["model_path"], weight_version, flush_cache=flush, urls=urls
        )
        phases["transfer"] = time.perf_counter() - t0
    else:
        await (begin if begin is not None else client.begin_weight_update(urls=urls))
        try:
            await transfer(client, groups, url, prepared, weight_version, await tp_size_of(), flush)
        except EngineError:
            # the engine refused a bucket and discarded the session: close it, so that its next
            # update (or another client's) can open one (the end answers 400: ignored)
            with contextlib.suppress(EngineError, EngineUnavailable):
                await client.end_weight_update(urls=urls)
            raise
        except BaseException:
            # interrupted (cancelled, or a bucket that could not be made): close the session
            # before going on, bounded (reconcile closes one left open before its next update)
            await _close_session(client, urls, atomic)
            raise
        if paused is not None:
            try:
                await paused
            except BaseException:  # not paused: the staged buckets must not go live
                await _close_session(client, urls, atomic)
                raise
        t1 = time.perf_counter()
        phases["transfer"] = t1 - t0
        await client.end_weight_update(urls=urls)
        phases["load"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    # the engine confirms by reporting the new version (read again every VERIFY_POLL_S; the
    # deadline in _update_within_deadline bounds it, errors end it)
    confirmed = AsyncRetrying(
        retry=retry_if_result(lambda got: got != weight_version), wait=wait_fixed(VERIFY_POLL_S)
    )
    await confirmed(weight_version_of, client, url)
    phases["verify"] = time.perf_counter() - t2
    return phases


async def _close_session(client: EngineClient, urls: list[str], atomic: bool) -> None:
    """End an interrupted session, bounded by CLOSE_TIMEOUT_S, errors ignored; `atomic`: discard
    what it staged (an engine that swaps at the end then keeps its version)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.end_weight_update(urls=urls, discard=atomic), CLOSE_TIMEOUT_S)


async def weight_version_of(client: EngineClient, url: str) -> str | None:
    return (await client.get_weight_version(urls=[url]))[url]


async def reports_version(client: EngineClient, url: str, version: int, timeout_s: float) -> bool:
    """Whether the engine's weight_version, read back (within timeout_s; errors: False), is
    `version`."""
    got = await bounded(weight_version_of(client, url), timeout_s)
    return got == str(version)
