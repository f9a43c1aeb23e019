"""Real model architectures with random weights, for GPU measurements where nothing can be downloaded.

`save_random_model("qwen2.5-0.5b", DIR)` writes a local Hugging Face directory (config, bf16
safetensors, a generated word-level tokenizer) that `python -m services.engine --model-path DIR`
and `shellrl.models.load_model(DIR)` load like any checkpoint. The architectures are Qwen2.5's
published configs (Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-7B config.json); only the weights are random.

Random weights give nearly uniform next-token distributions (logit std ~0.6 for the 0.5B shape),
on which any log-prob comparison passes trivially. `logit_std` sets the final norm's weight so the
logits have about that standard deviation, like a trained model's peaked distributions; the
parity measurements (issue 9) use 4.0.
"""

from __future__ import annotations

import math
from pathlib import Path

QWEN2_COMMON = {
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}

SHAPES: dict[str, dict] = {
    # Qwen/Qwen2.5-0.5B: 494M parameters, 0.99 GB in bf16 (embeddings tied to the LM head).
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen2.5-1.5B: 1.54B parameters, 3.1 GB in bf16 (embeddings tied to the LM head).
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen2.5-7B: 7.6B parameters, 15.2 GB in bf16 (separate LM head).
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # SmolLM2-135M's dimensions (the main job's model, a Llama; read from its GGUF) as a Qwen2:
    # the same tensors plus q/k/v biases (+28,800 parameters, 0.02%), for standalone pushes of its size
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    # A small Qwen2 for GPU tests: same code paths, seconds to build and load.
    "qwen2-small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 32000,
        "tie_word_embeddings": True,
    },
}


def qwen2_config(shape: str):
    """transformers Qwen2Config of a named shape (KeyError lists the names)."""
    from transformers import Qwen2Config

    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    return Qwen2Config(**QWEN2_COMMON, **SHAPES[shape])


def word_level_tokenizer(vocab_size: int):
    """A fast tokenizer whose token i is the word `t{i}` (0 <unk>, 1 <s>, 2 </s>): every id of the
    model decodes, and the engine needs no downloaded tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )


def random_model(
    shape: str, *, device: str = "cpu", dtype=None, seed: int = 0, logit_std: float | None = None
):
    """A Qwen2ForCausalLM of `shape` with random weights (initialized directly on `device`).

    dtype: default bfloat16. logit_std: see the module docstring (None keeps the init's norm of 1).
    """
    import torch
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model = model.to(dtype or torch.bfloat16)
    if logit_std is not None:
        scale = logit_std / (config.initializer_range * math.sqrt(config.hidden_size))
        with torch.no_grad():
            model.model.norm.weight.fill_(scale)
    return model.eval()


def save_random_model(
    shape: str,
    directory: str | Path,
    *,
    device: str = "cpu",
    dtype=None,
    seed: int = 0,
    logit_std: float | None = None,
):
    """Build `random_model(...)`, save it with its tokenizer into `directory`; returns the model."""
    model = random_model(shape, device=device, dtype=dtype, seed=seed, logit_std=logit_std)
    directory = Path(directory)
    model.save_pretrained(directory)
    word_level_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return model
