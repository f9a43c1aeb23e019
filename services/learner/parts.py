"""The learner's composition root: `build_parts(settings)` is the one place its settings become
constructor arguments (model, trainer, engines, weight sync, checkpoint store, the worker), and
`Parts` is what the routes (routes.py) and the lifespan (lifespan.py) receive. `trainer_config`
is also what a follower rank (follower.py) builds its Trainer with; `build_worker` what
tests/helpers/staleness_zero.py drives the learner's own loop with.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import redis.asyncio as aioredis
import torch
from fastapi import Depends

from services.learner.checkpoint import CheckpointStore
from services.learner.group_assembler import GroupAssembler
from services.learner.sample_table import SampleTable
from services.learner.settings import LearnerSettings
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from services.learner.weights.engine_membership import EngineMembership
from services.learner.weights.weight_dtype import checkpoint_dtype
from services.learner.weights.weight_sync import WeightSync
from services.learner.weights.weight_transport import choose_transport
from services.learner.worker import LearnerWorker, WorkerConfig
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_registry import model_fingerprint, model_summary
from shellrl.models import load_model, load_tokenizer, resolve_model_path
from shellrl.rl.losses import PPOConfig
from shellrl.service.parts import parts_dependency


@dataclass
class Parts:
    """Every component of one learner (rank 0), built by `build_parts`. worker_task: the training
    loop while it runs (lifespan.running sets it; None before)."""

    settings: LearnerSettings
    redis: aioredis.Redis
    client: EngineClient
    worker: LearnerWorker
    worker_task: asyncio.Task | None = None


PartsDep = Annotated[Parts, Depends(parts_dependency(Parts))]
"""A route's parameter `parts: PartsDep` receives the app's Parts (shellrl/service/parts.py)."""


def build_parts(settings: LearnerSettings) -> Parts:
    """Build the learner's components (blocking: loads the model; seconds). Connects nothing yet:
    Redis connects on first use."""
    redis = streams.connect(settings.redis_url)
    worker, client = build_worker(settings, redis)
    return Parts(settings, redis, client, worker)


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
    shards = streams.StreamShards(redis, s.shard_urls)  # shard 0: `redis` (shards.py)
    consumer = shards.consumer(
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
    worker.shards = shards
    return worker, client
