"""Settings of the learner (`SHELLRL_*` environment variables, see shellrl.service.settings).

Defaults suit SmolLM2-135M in float32 on a 2-core CPU with one local engine
(../shared/reference/feasibility.md: lr 1e-5, AdamW, grad clip 1.0, one inner update,
4 groups per step, zero-variance groups skipped).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator

from shellrl.service.auth import check_token
from shellrl.service.settings import TrainingScheduleSettings
from shellrl.tracking import PACKAGES, TrackingConfig, installed


class LearnerSettings(TrainingScheduleSettings):
    """The learner's settings; groups_per_step, max_staleness and dynamic_sampling are the
    gateway's too (`TrainingScheduleSettings`)."""

    default_port: ClassVar[int] = 8103

    # model and engines
    model_path: str = Field(
        "smollm2", description="'smollm2', 'tiny' or a HF directory (the initial policy)."
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="auto (cuda when available, else cpu), cpu, cuda or cuda:<index> (e.g. "
        "compose's learner, which also sees the engine's GPU).",
    )
    consumer_name: str = Field(
        "learner-0",
        description="Stable consumer name in group 'learner': after a restart "
        "the same name re-reads its own pending entries.",
    )
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads; 0 = torch's default (1 avoids "
        "thread oversubscription on a shared, busy CPU).",
    )
    malloc: Literal["jemalloc", "system"] = Field(
        "jemalloc",
        description="Allocator of the learner process (read by __main__ before start-up, see "
        "allocator.py): jemalloc when libjemalloc.so.2 is installed, else glibc.",
    )
    seed: int = Field(
        0,
        description="torch/numpy/python seed at a fresh start (a resume restores the RNG states).",
    )

    # ranks (torchrun --nproc-per-node N -m services.learner; ranks.py, data_parallel.py)
    fsdp: Literal["auto", "on", "off"] = Field(
        "auto",
        description="FSDP2 sharding of the model across the ranks: auto = on when torchrun's "
        "WORLD_SIZE > 1; on = also at world size 1 (a process group of one); off needs world "
        "size 1.",
    )
    distributed_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="The ranks' process group: auto = nccl on CUDA, else gloo."
    )
    distributed_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a rank waits for the others, seconds: at the rendezvous (start-up "
        "fails naming it) and in every collective (a dead or hung rank fails the others).",
    )
    lock_ttl_s: float = Field(
        30.0,
        ge=1,
        description="The learner lock in Redis (one learner per stream, learner_lock.py): its "
        "expiry, seconds, renewed every third of it; a learner that died without releasing "
        "it on another host is replaced after at most this long.",
    )

    # batches and groups (DESIGN.md section 5)
    group_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds after a group's first arrival before it is "
        "used incomplete (>= 2 valid members) or dropped.",
    )
    train_zero_variance_groups: bool = Field(
        False,
        description="Train on groups whose rewards are all equal "
        "(advantage 0: only the KL term moves).",
    )
    overlong_filtering: bool = Field(
        False,
        description="Loss mask 0 for trajectories cut by a length limit "
        "(finish_reason LENGTH or context budget); DAPO.",
    )
    temperature_source: Literal["trajectory", "fixed"] = Field(
        "trajectory",
        description="Where the log-prob temperature comes from: each segment's sampling.temperature "
        "(the engine's), or fixed_temperature for every token.",
    )
    fixed_temperature: float = Field(
        1.0, gt=0, description="Temperature used when temperature_source=fixed."
    )

    # optimisation
    lr: float = Field(1e-5, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup steps (LR of step k = lr * min(1, k / warmup))."
    )
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    grad_clip_norm: float = Field(1.0, ge=0, description="Max global gradient L2 norm (0 = off).")
    ppo_epochs: int = Field(
        1, ge=1, description="AdamW updates per batch (1: REINFORCE with a group baseline)."
    )
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    clip_eps_high: float = Field(0.28, ge=0)
    dual_clip_c: float = Field(3.0, gt=1, description="Dual clip for negative advantages.")
    behavior_weight_cap: float = Field(
        2.0, gt=0, description="C of min(exp(logp_prox - logp_behavior), C)."
    )
    max_log_ratio: float = Field(20.0, gt=0, description="Clamp of log-ratios before exp, nats.")
    kl_coef: float = Field(
        0.0, ge=0, description="k3 KL to the initial policy (0 = off; > 0 keeps a frozen copy)."
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward.")
    chunk_tokens: int = Field(
        1024, ge=1, description="LM-head positions per float32 chunk of one sequence."
    )
    pad_to_multiple_of: int = Field(
        64, ge=1, description="Round padded lengths up (fewer shapes, steadier RSS)."
    )
    gradient_checkpointing: bool = Field(
        True,
        description="Activation checkpointing of the decoder layers (less "
        "memory, ~25% more compute; turns prefix sharing off).",
    )
    share_prefix_min_tokens: int = Field(
        32,
        ge=0,
        description="Run a prefix common to a micro-batch's rows (a "
        "group's prompt) once when it has at least this many "
        "tokens; 0 = off. Needs gradient_checkpointing off.",
    )
    unpadded_rows: bool = Field(
        True,
        description="On CPU, after a shared prefix, run each row's own tokens alone, "
        "without padding (the same log-probs; issue 33 item 3).",
    )
    fused_optimizer: bool = Field(
        True, description="AdamW's fused kernel instead of its per-tensor loop (not with FSDP)."
    )
    reference_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Autocast dtype of the KL reference's decoder forward (its LM head stays "
        "float32); bfloat16 trades exactness for speed (BENCHMARKS.md, issue 33).",
    )

    # checkpoints
    checkpoint_dir: str = Field(
        ".shellrl/checkpoints", description="Checkpoints and the steps.jsonl ledger."
    )
    checkpoint_interval_steps: int = Field(
        10, ge=1, description="Checkpoint (then acknowledge) every N steps."
    )
    keep_checkpoints: int = Field(2, ge=1)
    max_steps: int = Field(
        0,
        ge=0,
        description="Pause training once the policy version reaches this (0 = no limit; POST "
        "/v1/resume does not go past it, unless given ?until_version=N, which replaces it until "
        "the next resume). `shellrl run` sets its --steps, so a learner with a "
        "backlog of trajectories does not train past them before the job's pause lands.",
    )
    start_paused: bool = Field(
        False,
        description="Start with training paused until POST /v1/resume (the resume push still "
        "runs). `shellrl run` does, so its evaluation before training scores exactly the policy "
        "the learner started from, even with trajectories left in the stream by an earlier run.",
    )
    fault_oom_at_step: int = Field(
        0,
        ge=0,
        description="Fault drill (0 = off): before training step N, ask the device's allocator "
        "for more bytes than the device has, so the real out-of-memory error ends the learner "
        "(how `shellrl run` reports a learner OOM and resumes, tests/gpu/test_gpu_stack.py). "
        "Only a learner that started fresh: one that resumed a checkpoint never fires it.",
    )

    # experiment tracking (shellrl/tracking.py; `shellrl run --tracker` sets it)
    tracker: Literal["auto", "none", "tensorboard", "wandb", "mlflow"] = Field(
        "auto",
        description="Where every step's metrics, the resolved settings and the sample tables go: "
        "auto = TensorBoard when installed (the images install it), else none; wandb runs "
        "offline (tracking_wandb_mode); mlflow writes a file store. A backend whose package is "
        "missing stops the start (ValueError naming the package).",
    )
    tracking_dir: str = Field(
        "",
        description="The tracker's directory ('' = <checkpoint_dir>/../tracking); the learner's "
        "run is <tracking_dir>/learner (event files, config.json).",
    )
    tracking_run_name: str = Field(
        "",
        description="The run's name ('' = the one kept in <tracking_dir>/run_name, made at the "
        "first start, so a restarted learner logs under the same name).",
    )
    tracking_project: str = Field("shellrl", description="W&B project / MLflow experiment.")
    tracking_wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B: offline (`wandb sync` uploads later) or online."
    )
    sample_table_interval_steps: int = Field(
        1,
        ge=0,
        description="Log a table of sampled episodes (prompt, actions and outputs, reward) every "
        "N steps (0 = never).",
    )
    sample_table_rows: int = Field(4, ge=1, description="Episodes per sample table.")

    # weight sync
    weight_transport: Literal["auto", "shm", "cuda_ipc", "distributed", "disk"] = Field(
        "auto",
        description="auto: CUDA IPC when the model is on a GPU and every engine is shellrl's on a GPU "
        "of this host, shared memory (SGLang's envelope) with engines on this host, else "
        "disk. distributed: a gloo/NCCL broadcast per engine (SGLang's "
        "update_weights_from_distributed), for engines on other GPUs or hosts.",
    )
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="distributed: the process groups' backend (auto: nccl for a model on a GPU, else gloo).",
    )
    weight_sync_master_address: str = Field(
        "",
        description="distributed: the address engines reach the learner's TCPStore at ('' = this host's "
        "address on the route to each engine; 127.0.0.1 for a local one).",
    )
    engine_cuda_device: str = Field(
        "",
        description="cuda_ipc: the engines' GPU, e.g. 'cuda:1' ('' = the "
        "learner's device); the bucket is staged there.",
    )
    shm_share_parameters: bool = Field(
        True,
        description="shm: the model's parameters live in the kept shared-"
        "memory segment, so a push copies nothing on the learner side.",
    )
    weight_sync_dir: str = Field(
        ".shellrl/weight_sync",
        description="Safetensors of the disk transport (must be readable by the engines).",
    )
    weight_sync_pause: Literal["auto", "off", "retract", "in_place"] = Field(
        "auto",
        description="Pause each engine around its update: retract or in_place (in-flight requests "
        "keep their tokens and continue on the new weights; no token is sampled between two "
        "buckets), off (SGLang runs each bucket under its writer lock, after in-flight requests), "
        "auto (SGLang: retract when a push takes more than one bucket, else off; shellrl's "
        "engine: in_place, as it commits only once no request runs when unpaused). in_place "
        "against SGLang needs --disable-radix-cache (refused otherwise).",
    )
    engine_admin_api_key: SecretStr | None = Field(
        None,
        description="SGLang's --admin-api-key: sent instead of the stack's token on the routes "
        "SGLang guards with it (weight updates, pause/continue, flush, abort). Served as "
        "'**********' in /v1/config.",
    )
    engine_admin_api_key_file: Path | None = Field(
        None,
        description="File holding engine_admin_api_key instead (a mounted secret); read at "
        "start-up, surrounding whitespace dropped.",
    )
    weight_bucket_bytes: int = Field(
        512 << 20,
        ge=1 << 20,
        description="The most bytes of one bucket (one update call), in the dtype it is sent in; "
        "a tensor larger than this goes alone. cuda_ipc and shm without shared parameters stream "
        "the buckets through two kept slots, so a push adds at most two buckets of memory (a "
        "bucket larger than the model: the whole model at once, the old single-bucket push).",
    )
    weight_sync_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The dtype cuda_ipc and streamed shm pushes are sent in (the copy into the "
        "bucket casts; services/learner/weights/weight_dtype.py): auto = the engines' dtype from their "
        "/server_info (SGLang's 'auto': the checkpoint's torch_dtype when 16-bit) when every "
        "engine serves the same 16-bit dtype, else float32; bfloat16 / float16 = that dtype; "
        "float32 = the learner's float32 (no cast). Never cast down for an engine that serves "
        "float32 or does not say (CPU engines).",
    )
    weight_sync_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Deadline of one engine's whole update, seconds "
        "(also torch's timeout of the distributed groups).",
    )
    engine_retry_interval_s: float = Field(
        5.0, gt=0, description="How often an out-of-rotation engine is probed."
    )

    # stream
    read_count: int = Field(64, ge=1, description="Entries per XREADGROUP.")
    block_ms: int = Field(1000, gt=0, lt=5000)
    claim_min_idle_ms: int = Field(
        86_400_000,
        ge=1000,
        description="The learner holds entries until a checkpoint covers them, so only "
        "entries idle for a day are re-claimed (one learner consumer).",
    )
    max_deliveries: int = Field(5, ge=1)

    def tracking_config(self) -> TrackingConfig:
        """The tracker settings (its directory: tracking_dir, else next to checkpoint_dir)."""
        return TrackingConfig(
            backend=self.tracker,
            directory=self.tracking_dir or str(Path(self.checkpoint_dir).parent / "tracking"),
            project=self.tracking_project,
            run_name=self.tracking_run_name,
            wandb_mode=self.tracking_wandb_mode,
        )

    @model_validator(mode="after")
    def _tracker_installed(self):
        """The tracker's package is installed (else the start fails here, naming it)."""
        if self.tracker in PACKAGES and not installed(self.tracker):
            raise ValueError(f"tracker {self.tracker!r}: pip install {PACKAGES[self.tracker]}")
        return self

    @model_validator(mode="after")
    def _one_admin_key_source(self):
        """At most one of engine_admin_api_key and engine_admin_api_key_file; the key must be a
        bearer token (`check_token`)."""
        if self.engine_admin_api_key is not None and self.engine_admin_api_key_file is not None:
            raise ValueError(
                "engine_admin_api_key and engine_admin_api_key_file: give one of them, not both"
            )
        if self.engine_admin_api_key is not None:
            self.engine_admin_api_key_value()
        return self

    def engine_admin_api_key_value(self) -> str | None:
        """SGLang's admin key the learner sends on its admin routes (None: not set). Reads the
        file on every call; ValueError naming the setting when it cannot be read or is no token."""
        if self.engine_admin_api_key is not None:
            try:
                return check_token(self.engine_admin_api_key.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"engine_admin_api_key: {exc}") from None
        if self.engine_admin_api_key_file is None:
            return None
        try:
            return check_token(self.engine_admin_api_key_file.read_text().strip())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(
                f"engine_admin_api_key_file {str(self.engine_admin_api_key_file)!r}: {exc}"
            ) from None
