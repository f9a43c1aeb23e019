"""Where a job's time went, from the services' last /metrics (the report's "Where the time goes"
section and timing.json): tokens per second of engine and rollout, each weight push and its phases,
how busy the engine and the learner were, what an episode's seconds went to, admission waits and
each service's peak GPU memory.

Inputs are Prometheus text (parsed with prometheus_client's own parser) and the job's phases
(`<phase>_s` wall seconds, cli/job_failure.py JOB_PHASES). Shares are fractions (0-1) of a wall
time: the engine's of the evaluations plus training (it serves both), the learner's of training.
A value that cannot be computed (a job cut short, a service that never answered) is None.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# an episode's seconds (sums over episodes, rollout histograms): what each part took
EPISODE_PARTS = ("generate", "session_create", "exec")


def parse(text: str) -> list:
    """Every sample (prometheus_client's `Sample`: name, labels, value) of a Prometheus text."""
    return [s for family in text_string_to_metric_families(text or "") for s in family.samples]


def samples(parsed: list, name: str, **labels: str) -> list[float]:
    """Values of the samples of `parsed` (`parse`) called `name` (e.g. `x_sum`, `x_total`) whose
    labels include `labels`."""
    return [
        s.value
        for s in parsed
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(parsed: list, name: str, **labels: str) -> float:
    """Sum of `samples(parsed, name, **labels)`; 0.0 when there is none."""
    return sum(samples(parsed, name, **labels))


def _ratio(a: float, b: float, digits: int = 3) -> float | None:
    return round(a / b, digits) if b > 0 else None


def timing(phases: dict, learner: str, rollout: str, engine: str) -> dict:
    """The numbers of the section (see the module docstring). phases: {"<phase>_s": seconds};
    learner, rollout, engine: each service's last /metrics text ("" when missing). Returns a JSON-
    able dict; tokens/s over the evaluations plus training (`busy_s`)."""
    learner, rollout, engine = parse(learner), parse(rollout), parse(engine)  # once each
    busy_s = sum(phases.get(f"{p}_s", 0.0) for p in ("eval_before", "train", "eval_after"))
    train_s = phases.get("train_s", 0.0)
    sync = "shellrl_weight_sync_seconds"
    pushes = total(learner, f"{sync}_count", phase="total")
    push_ms = {
        phase: round(1000 * total(learner, f"{sync}_sum", phase=phase) / pushes, 2)
        for phase in ("pause", "flatten", "fill", "transfer", "load", "verify", "continue", "total")
        if pushes
    }
    decode_steps = total(engine, "shellrl_engine_decode_step_seconds_count")
    engine_busy = total(engine, "shellrl_engine_decode_step_seconds_sum") + total(
        engine, "shellrl_engine_prefill_seconds_sum"
    )
    episode_s = total(rollout, "shellrl_rollout_episode_seconds_sum")
    waits: dict[str, float] = {}
    for s in rollout:
        if s.name == "shellrl_rollout_admission_wait_seconds_sum":
            reason = s.labels.get("reason", "")
            waits[reason] = round(waits.get(reason, 0.0) + s.value, 1)
    gpu_peak = {
        name: int(total(text, "shellrl_gpu_memory_bytes", kind="peak_allocated"))
        for name, text in (("engine", engine), ("learner", learner))
        if samples(text, "shellrl_gpu_memory_bytes", kind="peak_allocated")
    }
    return {
        "busy_s": round(busy_s, 1),
        "engine": {
            "generation_tokens_per_s": _ratio(
                total(engine, "shellrl_engine_generation_tokens_total"), busy_s, 1
            )
            if engine
            else None,  # a stack it did not start (`--attach`): no engine metrics
            "decode_steps": int(decode_steps),
            "decode_step_ms": _ratio(
                1000 * total(engine, "shellrl_engine_decode_step_seconds_sum"), decode_steps, 2
            ),
            "busy_share": _ratio(engine_busy, busy_s),
            # decode steps replayed from CUDA graphs (services/engine/graph_decode.py)
            "graph_step_share": _ratio(
                total(engine, "shellrl_engine_decode_steps_total", mode="graph"), decode_steps
            ),
        },
        "rollout": {
            "action_tokens_per_s": _ratio(
                total(rollout, "shellrl_rollout_tokens_total", kind="action"), busy_s, 1
            )
            if rollout
            else None,
            "episode_seconds_share": {
                part: _ratio(total(rollout, f"shellrl_rollout_{part}_seconds_sum"), episode_s)
                for part in EPISODE_PARTS
            },
            "admission_wait_s": waits,
        },
        "learner": {
            "busy_share": {
                "steps": _ratio(total(learner, "shellrl_learner_step_seconds_sum"), train_s),
                "weight_pushes": _ratio(total(learner, f"{sync}_sum", phase="total"), train_s),
                "checkpoints": _ratio(
                    total(learner, "shellrl_learner_checkpoint_seconds_sum"), train_s
                ),
            },
        },
        "weight_push": {"pushes": int(pushes), "mean_ms": push_ms},
        "gpu_memory_peak_bytes": gpu_peak,
    }


def _show(value, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:g}{unit}"


def _shares(shares: dict) -> str:
    return " / ".join(_show(v) for v in shares.values())


def timing_section(t: dict) -> list[str]:
    """The report's markdown lines for `timing(...)`."""
    engine, rollout, learner, push = t["engine"], t["rollout"], t["learner"], t["weight_push"]
    phases = ", ".join(f"{k} {v:g}" for k, v in push["mean_ms"].items() if k != "total")
    waits = ", ".join(f"{k} {v:g} s" for k, v in sorted(rollout["admission_wait_s"].items()))
    lines = [
        "## Where the time goes",
        "",
        f"Over the evaluations and training ({t['busy_s']:g} s); sums over episodes are "
        "episode-seconds.",
        "",
        f"- engine: {_show(engine['generation_tokens_per_s'])} generated tokens/s; decode step "
        f"{_show(engine['decode_step_ms'], ' ms')} mean over {engine['decode_steps']} steps "
        f"({_show(engine.get('graph_step_share'))} from CUDA graphs); busy "
        f"(decode + prefill) {_show(engine['busy_share'])} of the time",
        f"- rollout: {_show(rollout['action_tokens_per_s'])} ACTION tokens/s; an episode's "
        f"seconds: {' / '.join(EPISODE_PARTS)} {_shares(rollout['episode_seconds_share'])}",
        f"- admission waits (summed): {waits or 'none'}",
        f"- learner, share of training: steps / weight pushes / checkpoints "
        f"{_shares(learner['busy_share'])}",
        f"- weight push: {push['pushes']} pushes, mean {_show(push['mean_ms'].get('total'), ' ms')}"
        + (f" ({phases} ms)" if phases else ""),
    ]
    if t["gpu_memory_peak_bytes"]:
        peaks = ", ".join(
            f"{name} {b / 2**20:,.0f} MiB" for name, b in t["gpu_memory_peak_bytes"].items()
        )
        lines.append(f"- GPU memory, peak allocated by torch: {peaks}")
    return lines + [""]
