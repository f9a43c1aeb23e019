"""`shellrl run --device cuda` on one GPU (issue 19, item 1): the whole stack and the main job with
the engine (bf16) and the learner colocated on the current GPU, each within its memory fraction.

Skipped without CUDA; the job test also needs redis-server on PATH (benchmarks/run_gpu_stack.sh
brings one to the lent H200). The job uses the `tiny` model and trains zero-variance groups too
(`SHELLRL_TRAIN_ZERO_VARIANCE_GROUPS`), so every step runs the learner's forward/backward on the
GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from cli.stack_config import device_env
from services.learner.checkpoint import surviving_steps
from tests.gpu.conftest import requires_cuda
from tests.helpers.owned_processes import popen_owned, run_owned
from tests.helpers.processes import REPO

torch = pytest.importorskip("torch")
pytestmark = requires_cuda

BUDGET_PROBE = """
import torch
total = torch.cuda.get_device_properties(0).total_memory
kept = torch.empty(int(total * 0.005), dtype=torch.uint8, device="cuda")
try:
    torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    print("oom")
else:
    print("allocated")
"""


def probe(env: dict[str, str]) -> str:
    done = run_owned(
        [sys.executable, "-c", BUDGET_PROBE], env=env, capture_output=True, text=True, timeout_s=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_each_colocated_process_is_held_to_its_gpu_memory_fraction():
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTORCH_")}
    budget = device_env("cuda", "learner", {"engine": 0.01, "learner": 0.01}, environ=base)
    assert probe({**base, **budget}) == "oom"  # 2% of the GPU, past the learner's 1%
    assert probe(base) == "allocated"  # control: the same allocation without the budget


def gpu_apps() -> list[tuple[int, str, int]]:
    """(pid, GPU UUID, MiB used) of each process on each GPU, from nvidia-smi ([] without it)."""
    if shutil.which("nvidia-smi") is None:
        return []
    done = run_owned(
        [
            "nvidia-smi",
            "--query-compute-apps=pid,gpu_uuid,used_memory",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        timeout_s=30,
    )
    rows = [[x.strip() for x in line.split(",")] for line in done.stdout.splitlines()]
    return [
        (int(r[0]), r[1], int(r[2]))
        for r in rows
        if len(r) == 3 and r[0].isdigit() and r[2].isdigit()
    ]


def gpu_processes() -> dict[int, int]:
    """pid -> GPU memory used (MiB, over its GPUs) of the processes on a GPU."""
    used: dict[int, int] = {}
    for pid, _, mib in gpu_apps():
        used[pid] = used.get(pid, 0) + mib
    return used


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_run_device_cuda_trains_on_the_gpu_and_pushes_every_step(tmp_path):
    config = tmp_path / "gpu.toml"
    config.write_text("[env]\nSHELLRL_TRAIN_ZERO_VARIANCE_GROUPS = true\n")
    state = tmp_path / "state"
    argv = [
        sys.executable,
        "-m",
        "cli.main",
        "run",
        "--device",
        "cuda",
        "--config",
        str(config),
        "--model-path",
        "tiny",
        "--state-dir",
        str(state),
        "--steps",
        "2",
        "--time-budget-min",
        "4",
        "--group-size",
        "4",
        "--groups-per-step",
        "1",
        "--max-turns",
        "1",
        "--max-new-tokens",
        "16",
        "--eval-id-episodes",
        "2",
        "--eval-ood-episodes",
        "1",
        "--agentbench-eval-tasks",
        "1",
        "--tracker",
        "none",
    ]
    job = popen_owned(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, int] = {}  # service -> peak GPU MiB seen
    deadline = time.monotonic() + 480
    while job.poll() is None and time.monotonic() < deadline:
        stack = state / "stack.json"
        if stack.exists():
            pids = json.loads(stack.read_text())["processes"]
            used = gpu_processes()
            for name, pid in pids.items():
                if pid in used:
                    seen[name] = max(seen.get(name, 0), used[pid])
        time.sleep(2)
    if job.poll() is None:
        job.kill()
    output = job.communicate()[0]
    assert job.returncode == 0, output[-4000:]

    report = state / "report"
    assert json.loads((report / "phases.json").read_text())["device"] == "cuda"
    steps = json.loads((report / "steps.json").read_text())
    assert len(steps) >= 2 and sum(bool(s.get("trajectories")) for s in steps) >= 1
    pushes = re.search(
        r'shellrl_weight_sync_seconds_count\{phase="total"\} (\S+)',
        (report / "metrics_learner.prom").read_text(),
    )
    assert pushes and float(pushes.group(1)) >= 2  # the initial push and one per step
    for name in ("engine", "learner"):  # each one's GPU memory, from torch's allocator
        peak = re.search(
            r'shellrl_gpu_memory_bytes\{device="cuda:0",kind="peak_allocated"\} (\S+)',
            (report / f"metrics_{name}.prom").read_text(),
        )
        assert peak and float(peak.group(1)) > 0, name
    timing = json.loads((report / "timing.json").read_text())
    assert set(timing["gpu_memory_peak_bytes"]) == {"engine", "learner"}
    assert timing["weight_push"]["pushes"] >= 2
    if shutil.which("nvidia-smi"):
        total_mib = torch.cuda.get_device_properties(0).total_memory / 2**20
        assert set(seen) == {"engine", "learner"}, seen  # on the GPU: those two, nothing else
        # each within its fraction, plus its CUDA context (outside torch's allocator)
        assert (
            seen["engine"] <= 0.4 * total_mib + 1024 and seen["learner"] <= 0.5 * total_mib + 1024
        )


def tiny_job(state, config, steps: int, *extra: str) -> list[str]:
    """argv of a tiny-model `shellrl run --device cuda` job on `state`, small eval sets."""
    return [
        *(sys.executable, "-m", "cli.main", "run", "--device", "cuda", "--config", str(config)),
        *("--model-path", "tiny", "--state-dir", str(state), "--steps", str(steps)),
        *("--time-budget-min", "4", "--group-size", "4", "--groups-per-step", "1"),
        *("--max-turns", "1", "--max-new-tokens", "16", "--eval-id-episodes", "2"),
        *("--eval-ood-episodes", "1", "--agentbench-eval-tasks", "1", "--tracker", "none"),
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_a_real_cuda_oom_in_the_learner_stops_the_job_and_a_rerun_resumes(tmp_path):
    """Issue 19, Faults: the learner's CUDA OOM (the real allocator's error, forced by the
    SHELLRL_FAULT_OOM_AT_STEP drill before step 3; a checkpoint after every step) ends the job
    with status 1 and one line naming the learner, `oom`, the training phase and the checkpoint
    to resume from; the incomplete report says the same and `shellrl status` names the
    learner's exit. The rerun without --fresh resumes from step 2 and finishes all 4 steps."""
    state = tmp_path / "state"
    env_common = (
        "[env]\nSHELLRL_TRAIN_ZERO_VARIANCE_GROUPS = true\nSHELLRL_CHECKPOINT_INTERVAL_STEPS = 1\n"
    )
    drill = tmp_path / "drill.toml"
    drill.write_text(env_common + "SHELLRL_FAULT_OOM_AT_STEP = 3\n")
    plain = tmp_path / "plain.toml"
    plain.write_text(env_common)

    first = run_owned(
        tiny_job(state, drill, 4), cwd=REPO, capture_output=True, text=True, timeout_s=480
    )
    output = first.stdout + first.stderr
    assert first.returncode == 1, output[-4000:]
    line = next((ln for ln in output.splitlines() if "learner exited with status" in ln), "")
    assert "during train: oom" in line and "CUDA out of memory" in line, output[-4000:]
    assert "resume from step 2" in line, line
    summary = json.loads((state / "report" / "summary.json").read_text())
    incomplete = summary["incomplete"]
    assert (incomplete["service"], incomplete["class"], incomplete["phase"]) == (
        "learner",
        "oom",
        "train",
    ), incomplete
    assert incomplete["resume_from_step"] == 2
    status = run_owned(
        [sys.executable, "-m", "cli.main", "status", "--state-dir", str(state)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout_s=120,
    )
    assert "oom" in status.stdout + status.stderr, status.stdout + status.stderr

    second = run_owned(
        tiny_job(state, plain, 4), cwd=REPO, capture_output=True, text=True, timeout_s=480
    )
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    ledger = [
        json.loads(x) for x in (state / "checkpoints" / "steps.jsonl").read_text().splitlines()
    ]
    assert {"event": "resume", "step": 2, "checkpoint": "step-000002"} in ledger
    # steps 3 and 4 after the resume; none past --steps (the learner's SHELLRL_MAX_STEPS), though
    # the first run left a backlog of trajectories in the stream
    assert sorted(surviving_steps(ledger)) == [1, 2, 3, 4], ledger  # --steps 4, not a step past


def gpu_of_processes() -> dict[int, set[str]]:
    """pid -> UUIDs of the GPUs it holds memory on."""
    out: dict[int, set[str]] = {}
    for pid, uuid, _ in gpu_apps():
        out.setdefault(pid, set()).add(uuid)
    return out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the split layout)")
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_split_layout_puts_the_engine_and_the_learner_on_gpus_of_their_own(tmp_path):
    """Issue 19, item 1, on two GPUs: `--gpu-layout split` (what auto picks there) runs the engine
    on the first GPU and the learner on the second; the learner's pushes go over CUDA IPC into a
    bucket on the engine's GPU, so the learner holds memory there too, the engine never on the
    learner's."""
    config = tmp_path / "gpu.toml"
    config.write_text("[env]\nSHELLRL_TRAIN_ZERO_VARIANCE_GROUPS = true\n")
    state = tmp_path / "state"
    job = popen_owned(
        tiny_job(state, config, 2, "--gpu-layout", "split"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: dict[str, set[str]] = {}  # service -> GPU UUIDs
    deadline = time.monotonic() + 480
    while job.poll() is None and time.monotonic() < deadline:
        stack = state / "stack.json"
        if stack.exists():
            held = gpu_of_processes()
            for name, pid in json.loads(stack.read_text())["processes"].items():
                seen.setdefault(name, set()).update(held.get(pid, set()))
        time.sleep(2)
    if job.poll() is None:
        job.kill()
    output = job.communicate()[0]
    assert job.returncode == 0, output[-4000:]
    phases = json.loads((state / "report" / "phases.json").read_text())
    assert (phases["device"], phases["gpu_layout"]) == ("cuda", "split")
    pushes = re.search(
        r'shellrl_weight_sync_seconds_count\{phase="total"\} (\S+)',
        (state / "report" / "metrics_learner.prom").read_text(),
    )
    assert pushes and float(pushes.group(1)) >= 2
    if shutil.which("nvidia-smi"):
        [engine_gpu] = seen["engine"]
        assert seen["learner"] - {engine_gpu}, seen  # the learner trains on another GPU
