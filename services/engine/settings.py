"""Settings of the engine service (environment `SHELLRL_<FIELD>`, or the CLI flags of `__main__`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from shellrl.service.settings import ServiceSettings


class EngineSettings(ServiceSettings):
    """Read by services/engine only."""

    default_port: ClassVar[int] = 30000  # SGLang's default

    model_path: str = Field(
        "smollm2", description="'smollm2', 'tiny' or a local Hugging Face directory."
    )
    served_model_name: str | None = Field(
        None, description="Name reported by /model_info (default: model_path)."
    )
    device: str = Field("cpu", description="torch device: 'cpu', 'cuda', 'cuda:1'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model dtype; auto = float32 on CPU, bfloat16 on CUDA."
    )
    weight_version: str = Field(
        "default", description="Initial weight version string (SGLang --weight-version)."
    )
    max_running_requests: int = Field(64, ge=1, description="Requests decoded together at most.")
    max_prefill_tokens: int = Field(
        4096,
        ge=16,
        description="Padded tokens per prefill forward (rows x longest suffix); "
        "longer prompts are prefilled in chunks.",
    )
    prefix_cache: bool = Field(
        True, description="Reuse KV of shared token prefixes (SGLang: not --disable-radix-cache)."
    )
    prefix_cache_max_bytes: int = Field(
        1 << 30, ge=0, description="KV bytes the prefix cache may hold."
    )
    num_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = torch's default.")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="transformers attention kernel."
    )
    fp32_lm_head: bool = Field(
        True,
        description="LM head in float32 (hidden and weight cast up), as the learner "
        "computes it; bf16 logits cost ~0.03 nats of log-prob parity.",
    )
    cuda_graph: bool = Field(
        True,
        description="On a CUDA device, replay decode steps from CUDA graphs over a static KV arena "
        "(SGLang: not --disable-cuda-graph); ignored on CPU.",
    )
    cuda_graph_max_bs: int = Field(
        0,
        ge=0,
        description="Largest batch captured (SGLang --cuda-graph-max-bs); 0 = max_running_requests. "
        "A larger running batch decodes eagerly.",
    )
    cuda_graph_kv_columns: int = Field(
        2048,
        ge=16,
        description="KV columns of the graphs' static arena (positions on the running batch's "
        "shared time axis); a batch whose axis outgrows it decodes eagerly.",
    )
    health_check_timeout_s: float = Field(
        20.0, gt=0, description="/health_generate gives 503 after this."
    )
    register_url: str = Field(
        "",
        description="Where the gateway and learner reach this engine (e.g. http://<pod ip>:30000): "
        "when set, it registers itself in shellrl:engines at redis_url while it serves "
        "(registration.py); '' = no registration (name it in SHELLRL_ENGINE_URLS).",
    )
    register_heartbeat_s: float = Field(
        2.0, gt=0, description="Seconds between registry heartbeats; live for 3 of them."
    )
