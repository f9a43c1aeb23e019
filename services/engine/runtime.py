"""The engine's state behind the HTTP routes: model, tokenizer, scheduler, weight-update session.

Built once by `parts.build_parts` from `EngineSettings`. Routes (routes.py) translate HTTP to these
methods; everything that touches the model runs on the scheduler thread through `Scheduler.call`.

Weight-update session (SGLang 0.5.23 `/begin_weight_update` ... `/end_weight_update`): tensor
updates inside a session are validated and staged; `end` swaps all of them in at once between
decoding steps and sets the version (SGLang loads each call as it arrives; staging makes a
multi-bucket update atomic too). Disk updates need no session and go live on their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from services.engine import metrics
from services.engine.graph_decode import GraphDecoder
from services.engine.kv_batch import KVShape
from services.engine.prefix_cache import PrefixCache
from services.engine.protocol import ModelLimits, RequestSpec
from services.engine.sampling import SamplingSpec
from services.engine.scheduler import Scheduler
from services.engine.settings import EngineSettings
from services.engine.weights import StagedWeights, WeightStore, WeightUpdateError
from shellrl.models import load_model, load_tokenizer, resolve_model_path
from shellrl.weights import distributed as wd

log = logging.getLogger(__name__)

DRAIN_ANSWER_MARGIN_S = 5.0
GROUP_TIMEOUT_S = (
    120.0  # torch's timeout of a weight-update group: its rendezvous and each broadcast
)

SESSION_REQUIRED = "{} must run between begin_weight_update() and end_weight_update()"


@dataclass
class _Session:
    staged: StagedWeights = field(default_factory=StagedWeights)
    weight_version: str | None = None
    started_s: float = field(default_factory=time.perf_counter)
    failed: str | None = None
    abort_all: bool = False  # an update of the session asked for abort_all_requests


class EngineRuntime:
    """Model + scheduler + weight updates (see the module docstring)."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
        self.model_dir = resolve_model_path(settings.model_path)
        self.model = load_model(settings.model_path, dtype=dtype, device=settings.device)
        self.model.config._attn_implementation = settings.attn_implementation
        self.tokenizer = load_tokenizer(settings.model_path)
        config = self.model.config
        self.limits = ModelLimits(
            vocab_size=self.model.get_input_embeddings().weight.shape[0],
            context_length=int(getattr(config, "max_position_embeddings", 32768)),
        )
        eos = config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.graph = self._graph_decoder(settings)
        # graphs read the parameters' storages: updates are copied into them, never re-pointed
        self.weights = WeightStore(self.model, copy_on_commit=self.graph is not None)
        self.prefix_cache = PrefixCache(
            settings.prefix_cache_max_bytes, enabled=settings.prefix_cache
        )
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            weight_version=settings.weight_version,
            max_running_requests=settings.max_running_requests,
            max_prefill_tokens=settings.max_prefill_tokens,
            prefix_cache=self.prefix_cache,
            eos_token_ids=eos_ids,
            fp32_lm_head=settings.fp32_lm_head,
            graph=self.graph,
        )
        self.started_at = time.time()
        self._session: _Session | None = None
        self._update_lock = asyncio.Lock()
        self.groups = wd.ReceiverGroups(self.weights.device, GROUP_TIMEOUT_S)
        metrics.WEIGHT_UPDATE_GROUPS.set_function(lambda: len(self.groups.names()))

    def _graph_decoder(self, settings: EngineSettings) -> GraphDecoder | None:
        """The decode graphs on a CUDA device (captured here, before the engine serves)."""
        if not settings.cuda_graph or self.model.device.type != "cuda":
            return None
        graph = GraphDecoder(
            self.model,
            KVShape.of(self.model),
            max_rows=settings.cuda_graph_max_bs or settings.max_running_requests,
            columns=settings.cuda_graph_kv_columns,
            fp32_lm_head=settings.fp32_lm_head,
        )
        try:
            graph.capture()
        except Exception:  # a model whose forward cannot be captured still serves, eagerly
            log.exception("decode graphs could not be captured; decoding eagerly")
            del graph
            torch.cuda.empty_cache()
            return None
        return graph

    # ----- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.scheduler.start()

    def begin_drain(self) -> None:
        """SIGTERM: /health and readiness answer 503 and new generations get 503 `shutting_down`
        (uvicorn also stops accepting connections); running ones get `shutdown_grace_s` to finish,
        then end as aborts with their tokens so far (SGLang's abort shape). uvicorn's own grace is
        DRAIN_ANSWER_MARGIN_S longer (see `serve_grace_s`), so those answers go out before it
        cancels any handler. Call it on the loop's thread (`on_exit_signal`)."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: in-flight generations end as aborts in %.1f s", self.drain_s)
        self.loop.call_later(
            self.drain_s,
            lambda: self.scheduler.call(lambda: self.scheduler.abort("", abort_all=True)),
        )

    def on_exit_signal(self) -> None:
        """For `shellrl.service.app.serve`: runs in the signal handler; hands `begin_drain` to the loop."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.begin_drain)

    @property
    def drain_s(self) -> float:
        return self.settings.shutdown_grace_s

    @property
    def serve_grace_s(self) -> float:
        """uvicorn's graceful-shutdown timeout: the drain plus time for the aborts to be answered
        (a command runs between two scheduler steps; a long CPU prefill can hold it for seconds)."""
        return self.settings.shutdown_grace_s + DRAIN_ANSWER_MARGIN_S

    def stop(self) -> None:
        self.scheduler.stop()
        self.groups.close()

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    async def run(self, fn, *, when_idle: bool = False):
        """Run `fn` on the scheduler thread between steps and await its result."""
        return await asyncio.wrap_future(self.scheduler.call(fn, when_idle=when_idle))

    # ----- health --------------------------------------------------------------------------------------

    async def health_generate(self) -> bool:
        """One greedy token from input [0]; while paused, a scheduler round-trip instead (a paused
        SGLang server would block the probe until continue)."""
        timeout_s = self.settings.health_check_timeout_s
        try:
            if self.scheduler.paused:
                return bool(await asyncio.wait_for(self.run(lambda: True), timeout_s))
            spec = RequestSpec(
                rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                input_ids=(0,),
                max_new_tokens=1,
                sampling=SamplingSpec(temperature=0.0),
            )
            state = self.scheduler.submit(spec, asyncio.get_running_loop())
            done = await asyncio.wait_for(state.future, timeout_s)
            return done.finish_reason.get("status_code") is None
        except (TimeoutError, RuntimeError):
            return False

    # ----- weight updates ------------------------------------------------------------------------------

    def begin_session(self) -> None:
        if self._session is not None:
            raise WeightUpdateError(
                "a weight-update session is already open; call end_weight_update first"
            )
        if self._update_lock.locked():
            raise WeightUpdateError("an update_weights_from_disk is in progress")
        self._session = _Session()

    async def update_from_tensor(
        self, serialized_named_tensors, load_format, weight_version, abort_all: bool
    ) -> str:
        session = self._session
        if session is None:
            raise WeightUpdateError(SESSION_REQUIRED.format("update_weights_from_tensor"))
        try:
            staged = await self._timed_stage(
                self.weights.stage_serialized, serialized_named_tensors, load_format
            )
        except WeightUpdateError as exc:
            session.failed = str(exc)  # nothing of this session will be applied
            raise
        return await self._add_to_session(session, staged, weight_version, abort_all)

    async def _add_to_session(
        self, session: _Session, staged: StagedWeights, weight_version, abort_all: bool
    ) -> str:
        if abort_all:
            await self.run(lambda: self.scheduler.abort("", abort_all=True))
            session.abort_all = True
        session.staged.merge(staged)
        if weight_version is not None:
            session.weight_version = str(weight_version)
        message = (
            f"Success. Staged {len(staged.tensors)} tensors; they go live at end_weight_update."
        )
        return message + (
            f" Weight version updated to {weight_version}." if weight_version is not None else ""
        )

    # ----- the distributed path (shellrl.weights.distributed) --------------------------------------

    async def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join a weight-update group (SGLang's init_weights_update_group); WeightUpdateError naming
        the field for a bad request (at once) or a rendezvous that failed (within GROUP_TIMEOUT_S)."""
        try:
            self.groups.check_init(rank_offset, world_size, group_name, backend)
            await asyncio.to_thread(
                self.groups.init,
                master_address,
                master_port,
                rank_offset,
                world_size,
                group_name,
                backend,
            )
        except wd.GroupError as exc:
            raise WeightUpdateError(str(exc)) from exc

    async def destroy_group(self, group_name: str) -> None:
        try:
            self.groups.destroy(group_name)
        except wd.GroupError as exc:
            raise WeightUpdateError(str(exc)) from exc

    async def update_from_distributed(
        self, names, dtypes, shapes, group_name: str, load_format, weight_version, abort_all: bool
    ) -> str:
        """Receive one broadcast bucket and stage it into the open session (live at end). A failed
        receive destroys the group and discards the session (WeightUpdateError)."""
        session = self._session
        if session is None:
            raise WeightUpdateError(SESSION_REQUIRED.format("update_weights_from_distributed"))

        def receive_and_stage() -> StagedWeights:
            flat, metadata = self.groups.receive(group_name, names, dtypes, shapes, load_format)
            return self.weights.stage_bucket(flat, metadata)

        try:
            staged = await self._timed_stage(receive_and_stage)
        except (wd.GroupError, WeightUpdateError) as exc:
            session.failed = str(exc)
            raise WeightUpdateError(str(exc)) from exc
        return await self._add_to_session(session, staged, weight_version, abort_all)

    async def end_session(self, discard: bool = False) -> str:
        """Close the session: its staged buckets go live at once (with its weight_version), or,
        with `discard`, are dropped and nothing changes. WeightUpdateError when none is open or an
        update in it failed (then discarded)."""
        session, self._session = self._session, None
        if session is None:
            raise WeightUpdateError(
                "no weight-update session is open; call begin_weight_update first"
            )
        if discard:
            return "Success. Session discarded; nothing went live."
        if session.failed:
            raise WeightUpdateError(f"session discarded, an update in it failed: {session.failed}")
        if not session.staged.tensors and session.weight_version is None:
            return "Success. Nothing was staged."
        count = await self._commit(
            session.staged,
            session.weight_version,
            "tensor",
            session.started_s,
            abort_all=session.abort_all,
        )
        return f"Success. {count} tensors live, weight version {self.weight_version}."

    async def update_from_disk(self, model_path: str, weight_version, abort_all: bool) -> str:
        started = time.perf_counter()
        if self._session is not None:  # both would stage into the same spare arena
            raise WeightUpdateError(
                "a weight-update session is open; end it before update_weights_from_disk"
            )
        async with self._update_lock:
            staged = await self._timed_stage(self.weights.stage_disk, model_path)
            await self._commit(
                staged,
                None if weight_version is None else str(weight_version),
                "disk",
                started,
                abort_all=abort_all,
            )
        message = "Succeeded to update model weights."  # SGLang's text, and its suffix when a version is given
        return message + (
            f" Weight version updated to {weight_version}." if weight_version is not None else ""
        )

    async def _timed_stage(self, fn, *args) -> StagedWeights:
        """`fn(*args)` on a worker thread; its time and the hop's go to the phase histogram."""
        work_s = [0.0]

        def timed():
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                work_s[0] = time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(timed)
        finally:
            metrics.WEIGHT_UPDATE_PHASE_SECONDS.labels("stage").observe(work_s[0])
            metrics.WEIGHT_UPDATE_PHASE_SECONDS.labels("stage_hop").observe(
                time.perf_counter() - t0 - work_s[0]
            )

    async def _commit(
        self,
        staged: StagedWeights,
        weight_version: str | None,
        source: str,
        started_s: float,
        abort_all: bool = False,
    ) -> int:
        """Swap `staged` in between two steps: once no request is running (they finish on the old
        weights), or with `abort_all` at once, aborting in the same scheduler step whatever runs or
        waits then. An abort only at the update call would not do: requests that arrive before the
        swap (aborted episodes resumed at once) would run to their end first, holding the swap."""
        work_s = [0.0]

        def swap() -> int:
            t = time.perf_counter()
            if abort_all:
                self.scheduler.abort("", abort_all=True)
            self.scheduler.set_weights(lambda: self.weights.commit(staged), weight_version)
            work_s[0] = time.perf_counter() - t
            return len(staged.tensors)

        t0 = time.perf_counter()
        count = await self.run(swap, when_idle=not abort_all)
        metrics.WEIGHT_UPDATE_PHASE_SECONDS.labels("commit").observe(work_s[0])
        metrics.WEIGHT_UPDATE_PHASE_SECONDS.labels("commit_hop").observe(
            time.perf_counter() - t0 - work_s[0]
        )
        metrics.WEIGHT_UPDATE_SECONDS.labels(source).observe(time.perf_counter() - started_s)
        log.info(
            "weights updated",
            extra={"source": source, "tensors": count, "weight_version": self.weight_version},
        )
        return count

    async def set_weight_version(self, new_version: str, abort_all: bool) -> None:
        def apply() -> None:
            if abort_all:
                self.scheduler.abort("", abort_all=True)
            self.scheduler.weight_version = new_version

        await self.run(apply)

    # ----- info ----------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        config = self.model.config
        return {
            "model_path": self.settings.model_path,
            "served_model_name": self.settings.served_model_name or self.settings.model_path,
            "tokenizer_path": str(self.model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def server_info(self) -> dict:
        return {
            **self.settings.public_dict(),
            # the dtype it serves in (the setting says "auto"): the learner sends buckets in it
            "dtype": str(self.weights.dtype).removeprefix("torch."),
            "port": self.settings.listen_port,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": self.limits.context_length,
            "max_total_num_tokens": self.settings.prefix_cache_max_bytes
            // max(1, self.scheduler.kv_shape.bytes_per_token()),
            "incremental_streaming_output": False,
            "disable_radix_cache": not self.settings.prefix_cache,
            "internal_states": [self.loads()],
            "version": "shellrl-engine-0.1.0",
            "startup_time": self.started_at,
            "frontend": "python",
        }

    def loads(self) -> dict:
        loads = self.scheduler.loads()
        return {
            "dp_rank": 0,
            **loads,
            "cached_tokens": self.prefix_cache.tokens,
            "prefix_cache_bytes": self.prefix_cache.bytes,
            "weight_version": self.weight_version,
        }
