"""SGLang-compatible CPU (and single-GPU) inference engine on transformers; see docs/sglang.md."""
