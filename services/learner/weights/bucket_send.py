"""The buckets of a prepared push into one engine's open weight-update session, one at a time:
SGLang's tensor envelope (`update_weights_from_tensor`) or a gloo/NCCL broadcast beside
`update_weights_from_distributed`. engine_load.load_engine opens and ends the session around it.
"""

from __future__ import annotations

import inspect

from services.learner.weights.engine_groups import EngineGroups
from shellrl.clients.engine import EngineClient


async def transfer(
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
    urls, stream = [url], prepared.get("stream")
    try:
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
    finally:
        if stream is not None:
            stream.leave(url)
