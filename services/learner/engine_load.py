"""One engine's weight load: the transfer of a prepared version (SGLang's tensor envelope, a
gloo/NCCL broadcast, or a safetensors directory), the session end that swaps it in, and the read
back of its weight_version. WeightSync (weight_sync.py) runs it per engine under the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_result, wait_fixed

from services.learner.engine_groups import EngineGroups
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError, EngineUnavailable

CLOSE_TIMEOUT_S = 5.0  # the session's end after an interrupted transfer
VERIFY_POLL_S = 0.01  # how often an engine's weight_version is read until it reports the new one


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
    end only closes the session)."""
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
            await _transfer(
                client, groups, url, prepared, weight_version, await tp_size_of(), flush
            )
        except EngineError:
            # the engine refused a bucket and discarded the session: close it, so that its next
            # update (or another client's) can open one (the end answers 400: ignored)
            with contextlib.suppress(EngineError, EngineUnavailable):
                await client.end_weight_update(urls=urls)
            raise
        except BaseException:
            # interrupted (cancelled, or a bucket that could not be made): close the session
            # before going on, bounded (reconcile closes one left open before its next update)
            with contextlib.suppress(Exception):
                ending = client.end_weight_update(urls=urls, discard=atomic)
                await asyncio.wait_for(ending, CLOSE_TIMEOUT_S)
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


async def _transfer(
    client: EngineClient,
    groups: EngineGroups | None,
    url: str,
    prepared: dict,
    weight_version: str,
    tp_size: int,
    flush: bool = True,
) -> None:
    """Every bucket of `prepared` into the engine's open session (tensor envelope or broadcast),
    one at a time. A streamed push (`prepared["stream"]`, weight_transport.WeightStaging) gives
    awaitable buckets, filled into their slot on demand; the stream is told when this engine's
    update for a bucket returned (its slot may then take a later bucket) and when the engine is
    done, by success or failure (it then holds no slot, so no other engine waits on it)."""
    stream = prepared.get("stream")
    try:
        await _send_buckets(client, groups, url, prepared, weight_version, tp_size, flush)
    finally:
        if stream is not None:
            stream.leave(url)


async def _send_buckets(
    client: EngineClient,
    groups: EngineGroups | None,
    url: str,
    prepared: dict,
    weight_version: str,
    tp_size: int,
    flush: bool = True,
) -> None:
    urls, stream = [url], prepared.get("stream")
    group = await groups.group(url, tp_size) if "broadcast" in prepared else None
    buckets = prepared.get("buckets") or prepared["broadcast"]
    for i, bucket in enumerate(buckets):
        # the last flushes the KV of the old weights and alone carries the version: SGLang
        # records a bucket's weight_version as soon as it loaded it (scheduler_components/
        # weight_updater.py 242-246), so an earlier label would name weights half loaded
        last = i == len(buckets) - 1
        version_label = weight_version if last else None
        if group is None:
            entries = bucket(tp_size)
            if inspect.isawaitable(entries):  # a streamed bucket, filled when first asked for
                entries = await entries
            await client.update_weights_from_tensor(
                entries,
                weight_version=version_label,
                session=False,
                flush_cache=last and flush,
                urls=urls,
            )
            if stream is not None:  # the engine copied the bucket during the call
                stream.answered(url, i)
        else:
            sent = bucket(tp_size) if callable(bucket) else bucket
            if inspect.isawaitable(sent):  # a streamed bucket, filled when first asked for
                sent = await sent
            fields, flat = sent
            await groups.broadcast(
                url,
                group,
                flat,
                client.update_weights_from_distributed(
                    **fields,
                    group_name=group.name,
                    weight_version=version_label,
                    flush_cache=last and flush,
                    urls=urls,
                ),
            )
            if stream is not None:  # the broadcast is done: every rank received the bucket
                stream.answered(url, i)


async def weight_version_of(client: EngineClient, url: str) -> str | None:
    return (await client.get_weight_version(urls=[url]))[url]
