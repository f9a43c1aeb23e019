"""Weight sync: push the learner's weights to every engine after each step, then publish the version.

    flatten (plan the buckets; shm with shared parameters, distributed and disk also write them
    here; meanwhile each engine's session opens: begin_weight_update)
    ─▶ per engine, under one deadline: update_weights_from_tensor per bucket (streamed: each
    bucket filled into one of two slots when first asked for, "fill"; the engine copies it:
    "transfer") ─▶ end session (engine swaps the weights in: "load") ─▶ read back
    weight_version ("verify") ─▶ all engines in rotation confirmed: SET shellrl:policy:version,
    PUBLISH shellrl:policy:updates

Transports (SGLang's envelope over shared memory, CUDA IPC, a gloo/NCCL broadcast, safetensors on
disk) and the buffers kept across pushes are in weight_transport.py (`WeightStaging`;
`EngineGroups` in engine_groups.py; cuda_ipc and unshared shm stream through two slots,
`bucket_stream.py`, in the engines' dtype, `weight_dtype.py`); what a push learns about its
engines first (transport, dtype, pause, TP size) is in push_setup.py; this module talks to the
engines, keeps their rotation and publishes the version. Phase "fill" is the host time spent
filling slots during the transfer (a CUDA fill only enqueues its copies; the engine waits for
them inside "transfer").
An engine's TP size (one `serialized_named_tensors` entry per rank) and kind come from its
/server_info on first contact. The last bucket of a push sets `flush_cache` (SGLang would keep KV
computed by the old weights) and alone carries `weight_version`: SGLang records the version of
every bucket that carries one as soon as it loaded it, so a label on an earlier bucket would name
weights half loaded. With a pause (`pause_mode`; "auto": SGLang retract when the push takes more
than one bucket, shellrl's engine in_place: push_setup.pause_for) each engine's update runs
between pause_generation and continue_generation (engine_load.load_paused): SGLang releases its
writer lock between two bucket calls and would sample between them on half-new weights; paused,
in-flight requests keep their tokens, continue on the new weights, and a push never waits for
them. Paused in place, the last bucket asks for no flush: SGLang flushes only an idle scheduler
and would answer the bucket with an error after loading it (in_place is allowed against SGLang
only with its radix cache off). Checked on SGLang's own scheduler code:
tests/service/test_sglang_scheduler_harness.py. Phases: `shellrl_weight_sync_seconds{phase}`.

Guarantees:
* Never hangs: each engine's whole update runs under `deadline_s`; at the deadline the call is
  abandoned (cancelled without awaiting its clean-up) and the HTTP client's own timeout is the
  same deadline, so nothing waits on a frozen (SIGSTOP) or dead engine.
* An engine that does not confirm in time is reported (log, `shellrl_weight_sync_failures_total`,
  `status()` for GET /v1/status, and the Redis hash `shellrl:engines` that the gateway can read)
  and taken out of rotation; `reconcile()` probes it every `retry_interval_s` and, when it
  answers, brings it back with a full update to the current version.
* An engine whose update answered an error but that reports the new version when read back
  (SGLang answers `success: false` when a flush it was asked for is refused after loading) is
  confirmed, not taken out: its label and its weights agree.
* The version is published only when every engine still in rotation confirmed it and at least
  one did. When engines were taken out on this push, the publication says so (a warning log
  naming them, the `partial` flag, the status); with no engine confirming nothing is published.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

import redis.asyncio as aioredis
import torch

from services.learner import metrics
from services.learner.weights import weight_dtype
from services.learner.weights.engine_groups import EngineGroups
from services.learner.weights.engine_load import (
    CLOSE_TIMEOUT_S,
    load_engine,
    load_paused,
    reports_version,
)
from services.learner.weights.engine_rotation import (
    EngineState,
    SyncResult,
    bounded,
    publish_version,
    update_gauges,
    write_engine_states,
)
from services.learner.weights.push_setup import PAUSE_MODES, PushSetup
from services.learner.weights.weight_transport import BUCKET_BYTES, WeightStaging
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError, EngineUnavailable

log = logging.getLogger(__name__)


class WeightSync(PushSetup):
    """Pushes weights to `client.urls`. redis: where the version is published (None: never)."""

    def __init__(
        self,
        client: EngineClient,
        redis: aioredis.Redis | None,
        *,
        transport: str,
        deadline_s: float,
        sync_dir: str | Path,
        retry_interval_s: float = 5.0,
        bucket_bytes: int = BUCKET_BYTES,
        engine_device: str | None = None,
        share_parameters: bool = False,
        backend: str = "auto",
        master_address: str = "",
        pause_mode: str = "auto",
        dtype: str = "auto",
        checkpoint_dtype: str | None = None,
    ) -> None:
        """transport, sync_dir, bucket_bytes, engine_device, share_parameters: see `WeightStaging`
        (ValueError for a transport outside weight_transport.TRANSPORTS). backend, master_address:
        the distributed transport's (`EngineGroups`; backend "auto": NCCL for a model on a GPU,
        else gloo). pause_mode: "off", or "retract" / "in_place": each engine's update runs
        between pause_generation(mode) and continue_generation, so in-flight requests keep their
        tokens and resume on the new weights; "auto": retract when a push takes more than one
        bucket, else off. Nothing publishes the version with update_weight_version, whose
        abort_all_requests defaults to true (known_pitfalls D01). in_place against an SGLang
        engine whose radix cache is on raises PauseModeRefused at the first push (SGLang cannot
        flush the cache while a batch is paused in place). dtype: the push's dtype setting
        (weight_dtype.push_dtype: auto, float32, bfloat16, float16; streamed transports cast
        to it); checkpoint_dtype: the checkpoint's config dtype (for an SGLang engine whose
        /server_info says "auto"). An engine serving weights the learner cannot produce is never
        pushed to (push_setup._servable: DtypeRefused at the first push, later out of rotation)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}; got {pause_mode!r}")
        self.pause_mode = pause_mode
        weight_dtype.push_dtype(dtype, {})  # ValueError for an unknown setting
        self.dtype_setting, self.checkpoint_dtype = dtype, checkpoint_dtype
        self.push_dtype: str | None = None  # resolved at the first push (weight_dtype.push_dtype)
        self._staging_args = dict(
            sync_dir=sync_dir,
            bucket_bytes=bucket_bytes,
            engine_device=engine_device,
            share_parameters=share_parameters,
        )
        self.staging = WeightStaging(transport, **self._staging_args)
        self.backend, self.master_address = backend, master_address
        self.groups: EngineGroups | None = None
        self._resolved = transport != "cuda_ipc"
        self.client, self.redis, self.transport = client, redis, transport
        self.deadline_s, self.retry_interval_s = deadline_s, retry_interval_s
        self.engines = {u: EngineState(u) for u in client.urls}
        self.published_version: int | None = None
        self.last_result: SyncResult | None = None
        self._probe: asyncio.Future | None = None
        self._unpublished_reported: int | None = None
        # joins, leaves and restarts from the shellrl:engines registry, applied at each reconcile
        # (engine_membership.EngineMembership; None: the seed engines only)
        self.membership = None
        self._in_place_checked = False
        self._refusals_logged: dict[str, str] = {}  # url -> the refusal last logged (_servable)

    def close(self) -> None:
        """Release the kept buckets (unlink the shared-memory segments) and the process groups
        (the learner's side; `aclose` also has each engine destroy its own)."""
        self.staging.close()
        if self.groups is not None:
            self.groups.close()

    def status(self) -> dict:
        return {
            "transport": self.transport,
            "deadline_s": self.deadline_s,
            "published_version": self.published_version,
            "engines": [e.to_json() for e in self.engines.values()],
            "registry": None if self.membership is None else self.membership.status(),
            "last_push": None
            if self.last_result is None
            else {
                "version": self.last_result.version,
                "confirmed": list(self.last_result.confirmed),
                "failed": self.last_result.failed,
                "published": self.last_result.published,
                "partial": self.last_result.partial,
                "phases_s": {k: round(v, 4) for k, v in self.last_result.phases.items()},
            },
        }

    async def push(self, model: torch.nn.Module, version: int) -> SyncResult:
        """Full update of every engine in rotation to `version` (weight_version = str(version))."""
        targets = [u for u, e in self.engines.items() if e.in_rotation]
        await self._resolve(model, targets)
        result = await self._push(model, version, targets)
        result = replace(result, published=await self._publish(version, result.partial))
        self.last_result = result
        return result

    async def reconcile(self, model: torch.nn.Module, version: int) -> SyncResult | None:
        """Bring engines out of rotation back: a background health probe (at most every
        retry_interval_s, never blocking the caller) finds those that answer; they get a full
        update to `version` here. Also publishes `version` if it never was (no engine had it).
        First applies the registry's joins, leaves and restarts (`membership`), if any: engines
        that registered just now serve already, so they get their update without a probe."""
        joined = await self.membership.refresh() if self.membership is not None else []
        healthy: list[str] = list(joined)
        if self._probe is not None and self._probe.done():
            healthy += [u for u, ok in (self._probe.result() or {}).items() if ok]
            self._probe = None
        now = time.monotonic()
        due = [
            e
            for e in self.engines.values()
            if not e.in_rotation and now - e.last_probe_s >= self.retry_interval_s
        ]
        if self._probe is None and due:
            for e in due:
                e.last_probe_s = now
            self._probe = asyncio.ensure_future(
                bounded(self.client.health(urls=[e.url for e in due]), min(self.deadline_s, 5.0))
            )
        result = None
        healthy = [
            u
            for u in dict.fromkeys(healthy)
            if u in self.engines and not self.engines[u].in_rotation
        ]
        if healthy:
            announced = [u for u in healthy if not self.engines[u].refused]  # refused: _servable
            if announced:
                log.info(
                    "engines answer again; sending a full update",
                    extra={"engines": announced, "policy_version": version},
                )
            await self._end_stale_sessions(healthy)
            await self._resolve(model, healthy)
            result = await self._push(model, version, healthy)
        if self.published_version != version:
            published = await self._publish(
                version, any(not e.in_rotation for e in self.engines.values())
            )
            result = replace(result, published=published) if result is not None else None
        if result is not None:
            self.last_result = result
        return result

    # ----- one push ---------------------------------------------------------------------------------

    async def _push(self, model: torch.nn.Module, version: int, targets: list[str]) -> SyncResult:
        phases: dict[str, float] = {}
        start = time.perf_counter()
        failed: dict[str, str] = {}
        confirmed: list[str] = []
        if targets:
            targets = await self._servable(targets)
        if targets:
            await self._resolve_dtype(targets, model)
            pauses = await self._pauses(targets, self.staging.bucket_count(model))
            # Tensor transports: each engine's weight-update session (SGLang 0.5.23 requires one) opens
            # while the weights are copied, so its round trip costs no time of its own.
            # (not with a pause: SGLang's begin would wait behind in-flight requests before it)
            opening = (
                {}
                if self.transport == "disk"
                else {
                    u: asyncio.ensure_future(self.client.begin_weight_update(urls=[u]))
                    for u in targets
                    if pauses[u] == "off"
                }
            )
            t0 = time.perf_counter()
            try:
                # streamed: only the plan (buckets are filled as engines ask for them); cuda_ipc of
                # a sharded model: fill(sync=False) only enqueues the copies (~1 ms of host time,
                # less than a thread hop and its GIL waits); else copies, in a thread
                if self.transport == "cuda_ipc" or self.staging.streams(model):
                    prepared = self.staging.prepare(model, version, targets)
                else:
                    prepared = await asyncio.to_thread(self.staging.prepare, model, version)
            except BaseException:
                await self._abandon_sessions(opening)
                raise
            phases["flatten"] = time.perf_counter() - t0
            stream = prepared.get("stream")
            try:
                outcomes = await asyncio.gather(
                    *(
                        self._update_within_deadline(
                            u, prepared, version, pauses[u], opening.get(u)
                        )
                        for u in targets
                    )
                )
            finally:
                if stream is not None:
                    self.staging.end_push()
            if stream is not None:
                phases["fill"] = stream.fill_s
                metrics.WEIGHT_SYNC_RESIDENT_BYTES.set(stream.peak_resident_bytes)
            for url, (ok, detail) in zip(targets, outcomes):
                if ok:
                    confirmed.append(url)
                    for phase, seconds in detail.items():
                        phases[phase] = max(phases.get(phase, 0.0), seconds)
                else:
                    failed[url] = detail
            if any(reason.startswith("deadline") for reason in failed.values()):
                self.staging.close()  # an abandoned engine may still read these buffers: never refill them
            elif failed and self.transport in ("cuda_ipc", "distributed"):
                # an engine that failed may still read the CUDA bucket it was given (or come back as a
                # new process, to be given a fresh buffer); a failed broadcast's thread may still
                # read its bucket until torch's timeout
                self.staging.close()
        phases["total"] = time.perf_counter() - start
        for phase, seconds in phases.items():
            metrics.WEIGHT_SYNC_SECONDS.labels(phase).observe(seconds)
        for url in confirmed:
            e = self.engines[url]
            if not e.in_rotation:
                log.info(
                    "engine back in rotation", extra={"engine": url, "policy_version": version}
                )
            e.in_rotation, e.version, e.last_error, e.last_ok_at = (
                True,
                str(version),
                None,
                time.time(),
            )
            self.client.set_available(url, True)
        for url, reason in failed.items():
            e = self.engines[url]
            e.in_rotation, e.last_error, e.failures, e.tp_size = False, reason, e.failures + 1, None
            e.info_read = False  # a restarted engine may serve another dtype
            if self.groups is not None:
                self.groups.forget(url)
            self.client.set_available(url, False)
            metrics.WEIGHT_SYNC_FAILURES.labels(
                "deadline" if reason.startswith("deadline") else "error"
            ).inc()
            log.error(
                "engine did not confirm the weight update; taken out of rotation",
                extra={"engine": url, "policy_version": version, "reason": reason[:500]},
            )
        self._update_gauges()
        await self._write_engine_states()
        partial = bool(failed) or any(not e.in_rotation for e in self.engines.values())
        return SyncResult(version, tuple(confirmed), failed, False, partial, phases)

    async def _update_within_deadline(
        self,
        url: str,
        prepared: dict,
        version: int,
        pause: str = "off",
        begin: asyncio.Future | None = None,
    ) -> tuple[bool, dict | str]:
        """The engine's update under `deadline_s` (from after the weights were prepared: flattening or
        writing them is the learner's time, not the engine's). The HTTP client's timeout is the same
        length, so a call that timed out (EngineUnavailable.timed_out) is reported as the deadline
        too: the session opened during the flatten can time out just before the deadline's timer."""
        task = asyncio.ensure_future(self._update(url, prepared, version, pause, begin))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.deadline_s)
        except asyncio.CancelledError:  # the learner interrupted: the update stops, its session
            task.cancel()  # closes (load_engine, bounded) before the learner goes on
            await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S + 1.0)
            raise
        if "stream" in prepared:  # done with the buckets, whatever happened: no engine waits on it
            prepared["stream"].leave(url)
        deadline = f"deadline: no confirmation within {self.deadline_s:g} s"
        if not done:
            task.cancel()  # not awaited: its clean-up must not hold the learner past the deadline
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            return False, deadline
        try:
            return True, task.result()
        except EngineUnavailable as exc:
            return False, f"{deadline} ({exc})" if exc.timed_out else f"{type(exc).__name__}: {exc}"
        except EngineError as exc:
            if await reports_version(self.client, url, version, min(self.deadline_s, 5.0)):
                log.warning(
                    "engine answered an error but reports the new version; kept in rotation",
                    extra={"engine": url, "policy_version": version, "error": str(exc)[:500]},
                )
                return True, {}
            return False, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a broken payload or client bug: report, never crash the loop
            log.exception("weight update failed", extra={"engine": url})
            return False, f"{type(exc).__name__}: {exc}"

    async def _update(
        self,
        url: str,
        prepared: dict,
        version: int,
        pause: str = "off",
        begin: asyncio.Future | None = None,
    ) -> dict[str, float]:
        """begin: the engine's begin_weight_update, already sent (None: send it here)."""
        if pause == "off":
            return await self._load(url, prepared, version, begin)
        # paused in place, no flush: SGLang would refuse it with requests in the batch (and answer
        # the last bucket with an error after loading it); see push_setup.radix_cache_refusal
        return await load_paused(
            self.client,
            url,
            pause,
            bool(self.engines[url].commits_atomically),
            lambda paused: self._load(url, prepared, version, begin, pause != "in_place", paused),
        )

    async def _load(
        self,
        url: str,
        prepared: dict,
        version: int,
        begin: asyncio.Future | None,
        flush: bool = True,
        paused: asyncio.Future | None = None,
    ) -> dict[str, float]:
        return await load_engine(
            self.client,
            self.groups,
            url,
            prepared,
            version,
            begin,
            lambda: self._tp_size(url),
            flush,
            bool(self.engines[url].commits_atomically),
            paused,
        )

    # ----- publication -----------------------------------------------------------------------------

    async def publish_pending(self, version: int) -> bool:
        """Publish `version` if its publication failed before (Redis was restarting when the
        push ended) and every engine in rotation has it: no probe, no push. What the paused
        learner's loop calls, so that the gateway's admission bound does not stay a version or
        two behind the learner for as long as it is paused. True when `version` is published."""
        if self.published_version == version:
            return True
        return await self._publish(version, any(not e.in_rotation for e in self.engines.values()))

    async def _publish(self, version: int, partial: bool) -> bool:
        """SET + PUBLISH `version` if every engine in rotation (at least one) confirmed it."""
        if not any(e.in_rotation for e in self.engines.values()):
            if self._unpublished_reported != version:  # once per version, not on every loop
                self._unpublished_reported = version
                log.error(
                    "no engine has the new weights; version not published",
                    extra={"policy_version": version},
                )
            return False
        if await publish_version(self.redis, self.engines, version, partial):
            self.published_version = version
            return True
        return False

    def _update_gauges(self) -> None:
        update_gauges(self.engines)

    async def _write_engine_states(self) -> None:
        await write_engine_states(self.redis, self.engines)
