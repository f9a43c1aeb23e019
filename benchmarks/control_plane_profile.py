"""The latency profile of the control-plane benchmark's fakes, taken from recorded measurements.

    engine /generate latency   the GPU job's histogram shellrl_rollout_generate_seconds (one H200,
                               decode graphs, 10.5 ms mean decode step; docs/runs/
                               gpu-2026-12-05-graphs/s0/metrics_rollout.prom: 5,289 calls)
    episode shape              the same run: turns per episode (shellrl_rollout_turns_total /
                               episodes_total), action tokens per turn, observation tokens
    sandbox exec, create       BENCHMARKS.md "Sandbox": bubblewrap/session on a quiet host, exec
                               p50 3.69 / p99 4.85 ms, create p50 44.7 ms (a lognormal through
                               them; create's spread assumed equal to exec's)
    sandbox control calls      session info, kill, files, diff, delete: 2 ms (assumed; not
                               measured apart: the HTTP part of an exec, 3.69 - 1.74 ms)
    engine slots               64: the running batch of the engine benchmark's decode step and
                               the gateway's default in-flight cap, at which the job ran

`build_profile(tokenizer_ids)` returns the JSON the fakes load (tests/fakes/fake_latency.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from statistics import NormalDist

REPO = Path(__file__).resolve().parents[1]
GPU_RUN = REPO / "docs/runs/gpu-2026-12-05-graphs/s0/metrics_rollout.prom"
SANDBOX_EXEC_P50_S, SANDBOX_EXEC_P99_S = 3.69e-3, 4.85e-3  # BENCHMARKS.md "Sandbox", quiet host
SANDBOX_CREATE_P50_S = 44.7e-3
CONTROL_S = 2e-3
ENGINE_SLOTS = 64
BASH_REPLY = "<bash>ls -la | head -n 3</bash>"  # 15 tokens + end of turn: the job's 16.6 a turn
ANSWERS = ("<answer>5</answer>", "<answer>4</answer>")  # right and wrong: reward variance
STDOUT_CHARS = 125  # about 66 observation tokens a command, as in the job


def read_metrics(path: Path = GPU_RUN) -> dict[str, float]:
    """{'name{labels}': value} of a Prometheus text file."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def histogram(metrics: dict[str, float], name: str) -> dict:
    """A histogram's buckets as a Distribution body ({bounds, cumulative}); +Inf dropped."""
    buckets = []
    for key, value in metrics.items():
        m = re.fullmatch(rf'{name}_bucket\{{le="([^"]+)"\}}', key)
        if m and m.group(1) != "+Inf":
            buckets.append((float(m.group(1)), value))
    buckets.sort()
    total = metrics[f"{name}_count"]
    # the last finite bucket holds every sample in these runs; trim empty tails
    last = next(i for i, (_, c) in enumerate(buckets) if c >= total)
    buckets = buckets[: last + 1]
    return {"bounds": [b for b, _ in buckets], "cumulative": [c / total for _, c in buckets]}


def lognormal(p50_s: float, p99_s: float, points: int = 40) -> dict:
    """A lognormal through p50 and p99, as a Distribution body of `points` quantiles."""
    sigma = (math.log(p99_s) - math.log(p50_s)) / NormalDist().inv_cdf(0.99)
    qs = [(i + 1) / points for i in range(points)]
    qs[-1] = 0.999
    bounds = [p50_s * math.exp(sigma * NormalDist().inv_cdf(q)) for q in qs]
    qs[-1] = 1.0
    return {"bounds": bounds, "cumulative": qs}


def episode_shape(metrics: dict[str, float]) -> dict[str, float]:
    """Turns per episode, action tokens per turn, observation tokens per exec of the GPU job."""
    turns = metrics["shellrl_rollout_turns_total"]
    episodes = sum(v for k, v in metrics.items() if k.startswith("shellrl_rollout_episodes_total{"))
    execs = metrics["shellrl_rollout_exec_seconds_count"]
    return {
        "turns_per_episode": turns / episodes,
        "action_tokens_per_turn": metrics['shellrl_rollout_tokens_total{kind="action"}'] / turns,
        "observation_tokens_per_exec": metrics['shellrl_rollout_tokens_total{kind="observation"}']
        / execs,
        "generate_mean_s": metrics["shellrl_rollout_generate_seconds_sum"]
        / metrics["shellrl_rollout_generate_seconds_count"],
    }


def build_profile(tokenize, end_of_turn_id: int) -> dict:
    """The LatencyProfile body. tokenize(text) -> ids (the gateway's tokenizer)."""
    metrics = read_metrics()
    shape = episode_shape(metrics)
    spread = (SANDBOX_EXEC_P99_S / SANDBOX_EXEC_P50_S) * SANDBOX_CREATE_P50_S
    return {
        "generate_s": histogram(metrics, "shellrl_rollout_generate_seconds"),
        "create_s": lognormal(SANDBOX_CREATE_P50_S, spread),
        "exec_s": lognormal(SANDBOX_EXEC_P50_S, SANDBOX_EXEC_P99_S),
        "control_s": CONTROL_S,
        "slots": ENGINE_SLOTS,
        "answer_probability": 1 / shape["turns_per_episode"],
        "bash_ids": [*tokenize(BASH_REPLY), end_of_turn_id],
        "answer_ids": [[*tokenize(a), end_of_turn_id] for a in ANSWERS],
        "stdout_chars": STDOUT_CHARS,
        "sources": {"gpu_run": str(GPU_RUN.relative_to(REPO)), **shape},
    }
