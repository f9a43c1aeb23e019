"""Where a job's time went (cli/report_timing.py), from the metrics a real GPU run left
(docs/runs/gpu-2026-12-03/g32-lr4e-5: the services' last /metrics and the job's phases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from cli.report_timing import timing, timing_section
from shellrl.service.metrics import GPU_MEMORY_BYTES, GpuMemoryCollector, register_gpu_memory
from tests.helpers.processes import REPO

RUN = Path(REPO) / "docs/runs/gpu-2026-12-03/g32-lr4e-5"


def run_timing() -> dict:
    phases = json.loads((RUN / "phases.json").read_text())
    texts = [(RUN / f"metrics_{n}.prom").read_text() for n in ("learner", "rollout", "engine")]
    return timing(phases, *texts)


def test_the_numbers_of_a_real_run_match_its_metrics():
    t = run_timing()
    # phases.json: eval_before 20.2 s, train 422.1 s, eval_after 18.1 s (rounded here)
    assert t["busy_s"] == pytest.approx(460.4, abs=0.1)
    # metrics_engine.prom: 218,397 generated tokens; 7,549 decode steps taking 337.05 s;
    # prefill 95.99 s
    assert t["engine"]["generation_tokens_per_s"] == pytest.approx(218397 / 460.4, abs=0.2)
    assert t["engine"]["decode_steps"] == 7549
    assert t["engine"]["decode_step_ms"] == pytest.approx(1000 * 337.0537 / 7549, abs=0.01)
    assert t["engine"]["busy_share"] == pytest.approx((337.0537 + 95.9918) / 460.4, abs=0.002)
    # metrics_learner.prom: 67 pushes, 3.0436 s in all; steps 36.48 s of 422.1 s of training
    push = t["weight_push"]
    assert push["pushes"] == 67
    assert push["mean_ms"]["total"] == pytest.approx(1000 * 3.043644 / 67, abs=0.01)
    assert push["mean_ms"]["transfer"] == pytest.approx(1000 * 0.613275 / 67, abs=0.01)
    assert t["learner"]["busy_share"]["steps"] == pytest.approx(36.4775 / 422.1, abs=0.002)
    # metrics_rollout.prom: episodes 18,901 s, of which generate 13,668.5 s
    shares = t["rollout"]["episode_seconds_share"]
    assert shares["generate"] == pytest.approx(13668.51 / 18901.10, abs=0.001)
    assert t["rollout"]["admission_wait_s"]["sandbox_busy"] == pytest.approx(1022.0, abs=0.1)
    assert t["gpu_memory_peak_bytes"] == {}  # that run predates the gauge
    text = "\n".join(timing_section(t))
    assert "decode step 44.65 ms mean over 7549 steps" in text
    assert "67 pushes, mean 45.43 ms" in text


def test_a_job_cut_short_before_any_metrics_gives_none_not_an_error():
    t = timing({"eval_before_s": 12.0}, "", "", "")
    assert t["engine"]["generation_tokens_per_s"] is None  # no metrics: not 0 tokens/s
    assert t["rollout"]["action_tokens_per_s"] is None
    assert t["engine"]["decode_step_ms"] is None
    assert t["learner"]["busy_share"]["steps"] is None  # no training phase
    assert t["weight_push"] == {"pushes": 0, "mean_ms": {}}
    assert "n/a" in "\n".join(timing_section(t))


def test_gpu_memory_peaks_are_summed_over_each_services_gpus():
    engine = (
        f'{GPU_MEMORY_BYTES}{{device="cuda:0",kind="peak_allocated"}} 2147483648.0\n'
        f'{GPU_MEMORY_BYTES}{{device="cuda:0",kind="reserved"}} 4294967296.0\n'
    )
    learner = (  # the split layout: training on cuda:1, the push's bucket on the engine's cuda:0
        f'{GPU_MEMORY_BYTES}{{device="cuda:0",kind="peak_allocated"}} 1048576.0\n'
        f'{GPU_MEMORY_BYTES}{{device="cuda:1",kind="peak_allocated"}} 1073741824.0\n'
    )
    t = timing({"train_s": 10.0}, learner, "", engine)
    assert t["gpu_memory_peak_bytes"] == {"engine": 2**31, "learner": 2**30 + 2**20}
    assert "engine 2,048 MiB, learner 1,025 MiB" in "\n".join(timing_section(t))


def test_the_gpu_memory_gauge_has_no_samples_in_a_process_without_cuda():
    import sys

    from prometheus_client import CollectorRegistry

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.skip("this test process holds CUDA memory itself")
    registry = CollectorRegistry()
    register_gpu_memory(registry)
    register_gpu_memory(registry)  # once per registry
    text = generate_latest(registry).decode()
    assert f"# TYPE {GPU_MEMORY_BYTES} gauge" in text
    assert not [ln for ln in text.splitlines() if ln.startswith(GPU_MEMORY_BYTES)]
    [family] = GpuMemoryCollector().collect()
    assert family.samples == []
