"""GPU fixtures: a small Qwen2 with random weights, and the project's engine on the last GPU.

Test modules here mark themselves `requires_cuda` (skipped without CUDA). With two GPUs the
learner uses cuda:0 and the engine cuda:1 (the weight sync crosses devices, as on the lent
nvidia-h200-x2); with one, both share it.
"""

from __future__ import annotations

import pytest

from benchmarks.model_shapes import save_random_model
from shellrl.models import load_model
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port

torch = pytest.importorskip("torch")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPE = "qwen2-small"
LEARNER_DEVICE = "cuda:0"
ENGINE_DEVICE = f"cuda:{max(0, torch.cuda.device_count() - 1)}"


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory):
    """A saved qwen2-small checkpoint (bf16, peaked logits: logit_std 4) with its tokenizer."""
    directory = tmp_path_factory.mktemp("gpu-model") / "qwen2-small"
    save_random_model(SHAPE, directory, device=LEARNER_DEVICE, logit_std=4.0)
    torch.cuda.empty_cache()
    return directory


@pytest.fixture
def learner_model(gpu_model_dir):
    """The checkpoint's weights, freshly loaded on the learner GPU (bf16) for each test."""
    return load_model(str(gpu_model_dir), dtype=torch.bfloat16, device=LEARNER_DEVICE)


@pytest.fixture(scope="session")
def gpu_engine(gpu_model_dir, tmp_path_factory):
    """`python -m services.engine` on ENGINE_DEVICE serving the checkpoint (one for the session:
    every test pushes the full weights it checks, under its own versions)."""
    engine = ServiceProcess(
        "engine",
        free_port(),
        {
            "SHELLRL_MODEL_PATH": str(gpu_model_dir),
            "SHELLRL_DEVICE": ENGINE_DEVICE,
            "SHELLRL_LOG_LEVEL": "WARNING",
        },
        tmp_path_factory.mktemp("gpu-engine-logs"),
    )
    engine.start(ready_timeout_s=300.0)
    yield engine
    engine.stop()
