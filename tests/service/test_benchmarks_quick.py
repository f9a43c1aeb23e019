"""Every benchmark's quick form runs to its end and prints its tables (issue 37: the rollout
benchmark broke unseen because nothing ran it).

Each `benchmarks/bench_<name>.py --quick` runs as its own subprocess, as `python -m benchmarks`
runs it; the test checks the exit code and that the output has the table's headings and row
labels, never its numbers (these machines are noisy). A new benchmark needs an entry in PRINTS.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import available

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GPU_ONLY = {"gpu_weight_sync"}  # two CUDA devices; elsewhere it prints a skip line
PRINTS = {
    "data_parallel": ["Learner tokens/s on CPU", "1 rank, no FSDP", "2 ranks, FSDP2", "gather s"],
    "dynamic_sampling": ["| setting |", "| baseline |", "| dynamic sampling |", "| groups trained"],
    "engine": ["Engine batching", "Whole-model weight update", "with prefix cache", "speed-up"],
    "engine_fleet": ["joining engine", "x one full push", "pinned", "unpinned"],
    "gpu_weight_sync": ["bucket, one copy + CUDA IPC", "WeightSync"],
    "http": ["round trip", "h11", "httptools", "vs h11"],
    "learner": ["Learner step", "Peak memory", "Weight push end to end", "disk (baseline)"],
    "prefix_sharing": ["One group", "shared prefix, no checkpointing", "speed-up vs default"],
    "rollout": ["Gateway overhead", "aiohttp", "turns/s", "Long tail", "async strict k=2"],
    "sandbox": ["sandbox exec of `true`", "baseline: bash -c true", "bubblewrap/session"],
    "sandbox_warm_pool": ["episode start", "groups, 100 files, pool off", "pool on", "warm starts"],
    "streams": ["Streams:", "protobuf, raw LE bytes", "JSON (orjson, lists)", "vs JSON"],
    "verifier": ["Verifier: latency", "Verifier stream", "file_exists", "p50 ms"],
    "weight_envelope": ["Whole-model push", "SGLang envelope", "gloo broadcast", "vs disk"],
}
TIMEOUT_S = 420  # a quick form takes seconds to a minute and a half on 2 busy cores


def test_every_benchmark_has_a_quick_form_checked_here():
    assert sorted(PRINTS) == available()


def _two_cuda_devices() -> bool:
    import torch

    return torch.cuda.device_count() >= 2


@pytest.mark.parametrize("name", sorted(PRINTS))
def test_quick_form_runs_to_its_end_and_prints_its_tables(name, tmp_path):
    if name in GPU_ONLY and not _two_cuda_devices():
        pytest.skip(f"bench_{name} needs two CUDA devices")
    env = {**os.environ, "COLUMNS": "240", "SHELLRL_AUTH_DISABLED": "true"}
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.bench_{name}", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    printed = re.sub(r"\s+", " ", run.stdout)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    missing = [text for text in PRINTS[name] if text not in printed]
    assert not missing, f"{missing} not printed:\n{run.stdout[-4000:]}"
