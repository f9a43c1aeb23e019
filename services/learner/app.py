"""HTTP API of the learner; the app's lifespan builds the model, trainer, weight sync and worker.

GET  /v1/status       version, step, LR, last step's losses/clip fractions/importance weights/parity,
                      throughput, memory, pending groups, engines' state (in rotation, version, error)
POST /v1/checkpoints  write a checkpoint now (after the step in progress) -> 201 {"step", "path"}
POST /v1/pause        stop taking steps (the step in progress finishes) -> {"paused": true, "step": N}; with
                     ?wait=true it answers once that step and its weight push are done, so N is the
                     version the engines serve until /v1/resume (409 pause_timeout when that takes
                     longer than ?timeout_s; the learner stays paused)
POST /v1/resume       take steps again -> {"paused": false, "step": N, "step_target": T}; with
                     ?until_version=T the learner pauses itself once its policy version reaches T
                     (a training run's target_policy_version: no step past it), without it at
                     SHELLRL_MAX_STEPS (0: never)
POST /v1/kl           while paused: KL to the initial policy of given token sequences (eval
                     episodes) -> {"step": N, "sequences": [{"kl_sum", "tokens"}]} (kl_probe.py;
                     409 not_paused / no_reference / sharded)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal

import numpy as np
import torch
from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from services.learner import metrics
from services.learner.checkpoint import CheckpointStore
from services.learner.engine_membership import EngineMembership
from services.learner.group_assembler import DROP_REASONS, GroupAssembler
from services.learner.kl_probe import KlRequest, sequences_kl
from services.learner.sample_table import SampleTable
from services.learner.settings import LearnerSettings
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from services.learner.weight_dtype import checkpoint_dtype
from services.learner.weight_sync import WeightSync
from services.learner.weight_transport import choose_transport
from services.learner.worker import LearnerWorker, WorkerConfig
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_registry import model_fingerprint, model_summary
from shellrl.models import load_model, load_tokenizer, resolve_model_path
from shellrl.rl.losses import PPOConfig
from shellrl.service.aio import cancel_and_wait
from shellrl.service.app import ApiError, create_app
from shellrl.service.openapi import error_responses
from shellrl.streams import export_stream_stats

log = logging.getLogger(__name__)


def trainer_config(s: LearnerSettings) -> TrainerConfig:
    loss = PPOConfig(
        clip_eps_low=s.clip_eps_low,
        clip_eps_high=s.clip_eps_high,
        dual_clip_c=s.dual_clip_c,
        behavior_weight_cap=s.behavior_weight_cap,
        max_log_ratio=s.max_log_ratio,
        kl_coef=s.kl_coef,
        aggregation=s.loss_aggregation,
    )
    return TrainerConfig(
        lr=s.lr,
        weight_decay=s.weight_decay,
        betas=(s.adam_beta1, s.adam_beta2),
        warmup_steps=s.warmup_steps,
        grad_clip_norm=s.grad_clip_norm,
        ppo_epochs=s.ppo_epochs,
        micro_batch_size=s.micro_batch_size,
        chunk_tokens=s.chunk_tokens,
        gradient_checkpointing=s.gradient_checkpointing,
        share_prefix_min_tokens=s.share_prefix_min_tokens,
        unpadded_rows=s.unpadded_rows,
        fused_optimizer=s.fused_optimizer,
        reference_dtype=s.reference_dtype,
        loss=loss,
    )


def build_worker(s: LearnerSettings, redis) -> tuple[LearnerWorker, EngineClient]:
    """Model, trainer, engines, checkpoint store and the worker (blocking: loads the model)."""
    device = (
        "cuda"
        if s.device == "auto" and torch.cuda.is_available()
        else ("cpu" if s.device == "auto" else s.device)
    )
    if device.startswith("cuda:") and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # e.g. `--gpu-layout split`: the learner's GPU is cuda:1, the engine's (cuda:0) only holds
        # the push's bucket; kernels and the allocator default to the learner's own
        torch.cuda.set_device(torch.device(device))
    if s.num_threads:
        torch.set_num_threads(s.num_threads)
    torch.manual_seed(s.seed)
    np.random.seed(s.seed)
    random.seed(s.seed)
    model = load_model(s.model_path, dtype=torch.float32, device=device)
    tokenizer = load_tokenizer(s.model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    client = EngineClient(
        s.engine_url_list,
        timeout_s=s.weight_sync_timeout_s,
        connect_retries=1,
        api_token=s.api_token_value(),
        admin_api_token=s.engine_admin_api_key_value(),
        allow_empty=True,  # registered engines join (engine_membership.py)
    )
    transport = choose_transport(
        s.weight_transport, next(model.parameters()).device, s.engine_url_list
    )
    sync = WeightSync(
        client,
        redis,
        transport=transport,
        deadline_s=s.weight_sync_timeout_s,
        sync_dir=s.weight_sync_dir,
        retry_interval_s=s.engine_retry_interval_s,
        engine_device=s.engine_cuda_device or None,
        share_parameters=s.shm_share_parameters,
        bucket_bytes=s.weight_bucket_bytes,
        backend=s.weight_sync_backend,
        master_address=s.weight_sync_master_address,
        pause_mode=s.weight_sync_pause,
        dtype=s.weight_sync_dtype,
        checkpoint_dtype=checkpoint_dtype(resolve_model_path(s.model_path)),
    )
    config = model.config.to_dict()
    sync.membership = EngineMembership(
        redis,
        sync,
        model=s.model_path,
        fingerprint=model_fingerprint(config),
        summary=model_summary(config),
        refresh_s=s.engine_refresh_s,
    )
    consumer = streams.StreamConsumer(
        redis,
        streams.STREAM_TRAJECTORIES,
        streams.GROUP_LEARNER,
        s.consumer_name,
        block_ms=s.block_ms,
        count=s.read_count,
        claim_min_idle_ms=s.claim_min_idle_ms,
        max_deliveries=s.max_deliveries,
    )
    assembler = GroupAssembler(
        group_timeout_s=s.group_timeout_s,
        max_staleness=s.max_staleness,
        dynamic_sampling=s.dynamic_sampling,
    )
    config = WorkerConfig(
        groups_per_step=s.groups_per_step,
        checkpoint_interval_steps=s.checkpoint_interval_steps,
        train_zero_variance_groups=s.train_zero_variance_groups,
        overlong_filtering=s.overlong_filtering,
        fixed_temperature=s.fixed_temperature if s.temperature_source == "fixed" else None,
        pad_token_id=int(pad),
        pad_to_multiple_of=s.pad_to_multiple_of,
        read_count=s.read_count,
        fault_oom_at_step=s.fault_oom_at_step,
        start_paused=s.start_paused,
        max_steps=s.max_steps,
        tracking=s.tracking_config(),
        run_config=s.public_dict(),
    )
    worker = LearnerWorker(
        consumer,
        assembler,
        Trainer(model, trainer_config(s)),
        sync,
        CheckpointStore(s.checkpoint_dir, s.keep_checkpoints),
        config,
        samples=SampleTable(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            interval_steps=s.sample_table_interval_steps,
            rows=s.sample_table_rows,
        ),
    )
    return worker, client


def build_app(settings: LearnerSettings) -> FastAPI:
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        metrics.init_series(DROP_REASONS)
        redis = streams.connect(settings.redis_url)
        worker, client = await asyncio.to_thread(build_worker, settings, redis)
        stop = asyncio.Event()
        state.update(worker=worker, redis=redis, stop=stop)
        task = asyncio.create_task(worker.run(stop))
        task.add_done_callback(_log_exit)
        state["task"] = task
        stats = asyncio.create_task(
            export_stream_stats(redis, [(streams.STREAM_TRAJECTORIES, streams.GROUP_LEARNER)])
        )
        log.info(
            "learner started",
            extra={"config": settings.public_dict(), "transport": worker.sync.transport},
        )
        try:
            yield
        finally:
            stop.set()
            await worker.drain(settings.shutdown_grace_s)
            await cancel_and_wait(task, stats, timeout_s=10.0)
            await worker.sync.aclose()  # the engines destroy their weight-update groups too
            await client.close()
            await redis.aclose()

    async def ready_check() -> dict:
        worker, task = state.get("worker"), state.get("task")
        if worker is None or task is None or task.done():
            return {"ready": False, "reason": "worker not running"}
        if not worker.resumed.is_set():  # the checkpoint's weights not yet pushed to the engines
            return {"ready": False, "reason": "resuming", "version": worker.version}
        return {"ready": bool(await state["redis"].ping()), "version": worker.version}

    app = create_app(
        "learner",
        settings.public_dict(),
        ready_check,
        lifespan,
        api_token=settings.api_token_value(),
    )

    @app.get("/v1/status", tags=["learner"])
    async def status() -> dict:
        return state["worker"].status()

    @app.post("/v1/checkpoints", tags=["learner"], status_code=201, responses=error_responses(504))
    async def checkpoint() -> JSONResponse:
        future = state["worker"].request_checkpoint()
        try:
            result = await asyncio.wait_for(asyncio.shield(future), timeout=600)
        except TimeoutError:
            raise ApiError(
                504, "checkpoint_timeout", "the checkpoint did not finish within 600 s"
            ) from None
        return JSONResponse(result, status_code=201)

    @app.post("/v1/pause", tags=["learner"], responses=error_responses(409, 422))
    async def pause(wait: bool = False, timeout_s: float = Query(900.0, gt=0, le=3600)) -> dict:
        worker = state["worker"]
        worker.running.clear()
        if wait:
            try:
                await asyncio.wait_for(worker.paused_idle.wait(), timeout=timeout_s)
            except TimeoutError:  # paused all the same: the caller's wait ran out, no server fault
                raise ApiError(
                    409,
                    "pause_timeout",
                    f"paused, but the step in progress did not finish within {timeout_s:g} s; "
                    "call again to wait longer",
                    "timeout_s",
                ) from None
        return {"paused": True, "step": worker.version}

    @app.post("/v1/resume", tags=["learner"], responses=error_responses(422))
    async def resume(until_version: int | None = Query(None, ge=0)) -> dict:
        worker = state["worker"]
        worker.resume_training(until_version)
        return {"paused": False, "step": worker.version, "step_target": worker.step_target}

    @app.post("/v1/kl", tags=["learner"], responses=error_responses(409, 422))
    async def kl(body: KlRequest) -> dict:
        worker = state["worker"]
        trainer = worker.trainer
        if trainer.reference_policy is None:
            raise ApiError(409, "no_reference", "no reference policy (SHELLRL_KL_COEF is 0)")
        if trainer.sharded:
            raise ApiError(409, "sharded", "a sharded learner does not score sequences")
        if worker.running.is_set() or not worker.paused_idle.is_set():
            raise ApiError(409, "not_paused", "pause the learner first (POST /v1/pause?wait=true)")
        try:
            rows = await asyncio.to_thread(
                sequences_kl, trainer, body.sequences, worker.config.pad_token_id
            )
        except ValueError as exc:
            raise ApiError(422, "invalid_sequence", str(exc), "sequences") from None
        return {"step": worker.version, "sequences": [r.__dict__ for r in rows]}

    return app


def _log_exit(task: asyncio.Task) -> None:
    """A worker that died of an error takes the process down (SIGTERM to itself), so the
    supervisor restarts it from the last checkpoint instead of serving a learner that never trains."""
    if not task.cancelled() and task.exception() is not None:
        log.error("learner worker stopped with an error; exiting", exc_info=task.exception())
        os.kill(os.getpid(), signal.SIGTERM)
