"""`shellrl run --device cuda` / `shellrl up --device cuda` (issue 19, item 1): engine (bf16) and
learner colocated on one GPU, each within its fraction of the GPU's memory; without a CUDA GPU the
flag fails at once with one line, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cli.errors import CliError
from cli.job_config import JobConfig
from cli.main import parse
from cli.stack_config import (
    GPU_MEMORY_FRACTIONS,
    SERVICE_ORDER,
    StackConfig,
    check_device,
    device_env,
    resolve_gpu_layout,
)
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO


def shellrl_without_gpu(*args: str) -> subprocess.CompletedProcess:
    """The real command, with every GPU hidden (so the test means the same on a GPU host)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return run_owned(
        [sys.executable, "-m", "cli.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout_s=120,
    )


@pytest.mark.parametrize("command", ["run", "up"])
def test_device_cuda_without_a_gpu_fails_at_once_with_one_line(command, tmp_path):
    state = tmp_path / "state"
    done = shellrl_without_gpu(command, "--device", "cuda", "--state-dir", str(state))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(
        f"shellrl {command}: error: --device cuda: no CUDA GPU visible to torch "
    )
    assert line.endswith("; use --device cpu")
    assert done.stdout == "" and not state.exists()  # nothing started, nothing written


def test_gpu_memory_fractions_over_the_whole_gpu_are_refused_before_torch_is_asked():
    with pytest.raises(
        CliError, match=r"fractions \(engine 0.6, learner 0.5\) must be in \(0, 1\]"
    ):
        check_device("cuda", {"engine": 0.6, "learner": 0.5}, "colocated")
    with pytest.raises(CliError, match="must be in"):
        check_device("cuda", {"engine": 0.0, "learner": 0.5})  # any layout
    assert check_device("cpu", {"engine": 0.6, "learner": 0.5}) == "colocated"  # unused on CPU
    with pytest.raises(CliError, match="expected one of cpu, cuda"):
        check_device("tpu")
    with pytest.raises(CliError, match="expected one of auto, colocated, split"):
        check_device("cpu", None, "three")


def test_the_gpu_layout_splits_on_two_gpus_and_shares_one():
    assert [resolve_gpu_layout("auto", n) for n in (1, 2, 8)] == ["colocated", "split", "split"]
    assert resolve_gpu_layout("colocated", 2) == "colocated"
    assert resolve_gpu_layout("split", 2) == "split"
    with pytest.raises(CliError, match="needs two GPUs, torch sees 1"):
        resolve_gpu_layout("split", 1)


def test_split_leaves_room_on_the_engines_gpu_for_the_learners_bucket():
    from cli.stack_config import SPLIT_ENGINE_MAX_FRACTION

    assert SPLIT_ENGINE_MAX_FRACTION == 0.85
    with pytest.raises(CliError, match=r"engine's fraction \(engine 0.95, learner 0.5\) must be"):
        check_device("cuda", {"engine": 0.95, "learner": 0.5}, "split")


def test_split_puts_the_engine_on_the_first_gpu_and_the_learner_on_the_second():
    fractions = {"engine": 0.8, "learner": 0.9}  # each of its own GPU: no sum limit
    engine = device_env("cuda", "engine", fractions, environ={}, layout="split")
    assert engine == {
        "SHELLRL_DEVICE": "cuda",
        "SHELLRL_DTYPE": "bfloat16",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.8",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    # the learner sees the engine's GPU first (its cuda:0, where a push's CUDA IPC bucket is
    # staged) and trains on its own (cuda:1)
    learner = device_env("cuda", "learner", fractions, environ={}, layout="split")
    assert learner == {
        "SHELLRL_DEVICE": "cuda:1",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.9",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SHELLRL_ENGINE_CUDA_DEVICE": "cuda:0",
    }
    # the first two of the GPUs the host's CUDA_VISIBLE_DEVICES leaves visible
    visible = {"CUDA_VISIBLE_DEVICES": "3,5,6"}
    assert (
        device_env("cuda", "engine", environ=visible, layout="split")["CUDA_VISIBLE_DEVICES"] == "3"
    )
    learner = device_env("cuda", "learner", environ=visible, layout="split")
    assert learner["CUDA_VISIBLE_DEVICES"] == "3,5"
    with pytest.raises(CliError, match="names one GPU"):
        device_env("cuda", "learner", environ={"CUDA_VISIBLE_DEVICES": "2"}, layout="split")
    for name in ("sandbox", "verifier", "rollout"):
        assert device_env("cuda", name, environ={}, layout="split") == {"CUDA_VISIBLE_DEVICES": ""}


def test_cpu_puts_engine_and_learner_on_the_cpu_and_leaves_the_rest_alone():
    for name in SERVICE_ORDER:
        expected = {"SHELLRL_DEVICE": "cpu"} if name in ("engine", "learner") else {}
        assert device_env("cpu", name, environ={}) == expected


def test_cuda_colocates_engine_and_learner_each_with_its_memory_budget():
    assert sum(GPU_MEMORY_FRACTIONS.values()) <= 1
    engine = device_env("cuda", "engine", environ={})
    assert engine == {
        "SHELLRL_DEVICE": "cuda",
        "SHELLRL_DTYPE": "bfloat16",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.4",
    }
    learner = device_env("cuda", "learner", {"engine": 0.3, "learner": 0.6}, environ={})
    assert learner == {
        "SHELLRL_DEVICE": "cuda",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.6",
    }
    for name in ("sandbox", "verifier", "rollout"):  # never touch the GPU
        assert device_env("cuda", name, environ={}) == {"CUDA_VISIBLE_DEVICES": ""}


def test_cuda_keeps_the_allocator_options_already_set():
    # the user's options are theirs: no expandable_segments added beside them
    env = device_env("cuda", "engine", environ={"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:False,per_process_memory_fraction:0.4"
    env = device_env(
        "cuda",
        "learner",
        environ={"PYTORCH_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.9"},
    )
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True,per_process_memory_fraction:0.5"
    # torch reads PYTORCH_CUDA_ALLOC_CONF first: the budget goes where torch will look
    env = device_env("cuda", "engine", environ={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,per_process_memory_fraction:0.4"
    assert "PYTORCH_ALLOC_CONF" not in env


def test_the_job_passes_device_and_budgets_to_the_stack_and_owns_their_settings(tmp_path):
    stack = JobConfig(device="cuda", engine_gpu_memory=0.25, learner_gpu_memory=0.7).stack_config()
    assert isinstance(stack, StackConfig) and stack.device == "cuda"
    assert stack.gpu_memory == {"engine": 0.25, "learner": 0.7}
    assert JobConfig().stack_config().device == "cpu"
    split = JobConfig(device="cuda", gpu_layout="split").stack_config()
    assert split.gpu_layout == "split"
    assert {"SHELLRL_ENGINE_CUDA_DEVICE"} <= JobConfig().managed_env()
    assert {"SHELLRL_DEVICE", "SHELLRL_DTYPE"} <= JobConfig().managed_env()
    config = tmp_path / "shellrl.toml"
    config.write_text('device = "cuda"\nengine-gpu-memory = 0.3\n')
    args = parse(["run", "--config", str(config)])
    assert (args.device, args.engine_gpu_memory, args.learner_gpu_memory) == ("cuda", 0.3, 0.5)
    assert parse(["up", "--config", str(config), "--device", "cpu"]).device == "cpu"
    assert parse(["run"]).gpu_layout == "auto"
    assert parse(["up", "--gpu-layout", "split"]).gpu_layout == "split"
