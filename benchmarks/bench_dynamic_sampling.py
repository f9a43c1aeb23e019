"""Dynamic sampling and pass-rate steering, simulated on the real admission path (issue 20).

The gateway's real parts on a real redis-server: the task pool (seeded epochs) with or without
`Steering`, the staleness-bounded `Admission` (its Lua scripts, including dynamic sampling's
give-back through `member_scored`), and the learner's real `GroupAssembler` (counting as the
learner counts). Only the episodes and the clock are simulated: a group's rewards are Bernoulli
draws of its template's pass rate, generation is one pipeline of `episodes_per_s` (a group ends
G / episodes_per_s after the previous one), and a learner step takes `learner_s_per_trajectory`
per trained trajectory (0 for a step that trains nothing). Defaults follow run9 of the main job
on the 2-core machine (docs/runs/main-job/steps.json): G = 8, B = 4, max_staleness 1, 8 groups
in flight, 0.75 episodes/s (28 steps of 4 groups in 20.1 min), 2.6 s of learner compute per
trained trajectory (median of its trained steps: 21 s per group), 20 minutes of training.

Pass rates: the base policy's, from docs/runs/pass-rates/pass_rates_T0.7.json ((s + 0.5) /
(n + 1): 0/12 becomes 4 %), 1 % for the seed tasks. `--learning-logit X`: a toy of learning,
each trained group of a template adds X to the logit of its pass rate (0 = the base policy
throughout: what the sampling rules alone do).

Reported per configuration (baseline, dynamic sampling, steering, both), each over `--seeds`:
learner steps, the fraction of steps that trained, groups trained per step, trained groups in
the budget, episodes generated per trained group, groups dropped stale, and the share of episodes
spent on templates whose pass rate is below 10 %.

Run: `python -m benchmarks dynamic_sampling` (or `python -m benchmarks.bench_dynamic_sampling
--seeds 3 --learning-logit 0.15`; `--quick`: 1 seed, 2 simulated minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from services.learner.group_assembler import GroupAssembler
from services.rollout.admission import Admission
from services.rollout.policy_version import PolicyVersionWatcher
from services.rollout.steering import Steering, SteeringConfig, template_key
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from shellrl.rl.dynamic_sampling import has_variance, reward_key
from shellrl.streams import POLICY_VERSION_KEY, connect
from tests.helpers.redis_server import RedisServer
from tests.helpers.trajectories import make_trajectory

ROOT = Path(__file__).resolve().parent.parent
PASS_RATES = ROOT / "docs/runs/pass-rates/pass_rates_T0.7.json"


@dataclass(frozen=True)
class SimConfig:
    dynamic_sampling: bool = False
    steering: bool = False
    budget_s: float = 20 * 60.0
    group_size: int = 8
    groups_per_step: int = 4
    max_staleness: int = 1
    groups_in_flight: int = 8
    episodes_per_s: float = 0.75
    learner_s_per_trajectory: float = 2.6
    learning_logit: float = 0.0
    steering_window: int = 32
    seed: int = 0


@dataclass
class Result:
    steps: int = 0
    steps_trained: int = 0
    groups_trained: int = 0
    groups_generated: int = 0
    groups_stale: int = 0
    episodes_low_rate: int = 0  # episodes of templates whose pass rate is below 10 %


def base_rates() -> dict[str, float]:
    data = json.loads(PASS_RATES.read_text())
    return {t["template"]: (t["successes"] + 0.5) / (t["episodes"] + 1) for t in data["templates"]}


def training_pool() -> list:
    from cli.job_config import JobConfig
    from cli.job_tasks import train_tasks

    return train_tasks(JobConfig())


async def simulate(redis, cfg: SimConfig, tasks: list, rates: dict[str, float]) -> Result:
    """One simulated training phase (module docstring) on a flushed Redis."""
    await redis.flushdb()
    rng, store = random.Random(cfg.seed), TaskStore(redis)
    for t in tasks:
        await store.submit(t)
    steering = (
        Steering(redis, SteeringConfig(window_episodes=cfg.steering_window, seed=cfg.seed))
        if cfg.steering
        else None
    )
    pool = TaskPool(redis, store, consumer="sim", seed=cfg.seed, steering=steering)
    feeder = asyncio.create_task(pool.feed())
    while await pool.size() < len(tasks):
        await asyncio.sleep(0.01)
    admission = Admission(
        redis,
        PolicyVersionWatcher(redis),
        replica="sim",
        max_staleness=cfg.max_staleness,
        groups_per_step=cfg.groups_per_step,
        dynamic_sampling=cfg.dynamic_sampling,
    )
    assembler = GroupAssembler(
        group_timeout_s=1e9, max_staleness=cfg.max_staleness, dynamic_sampling=cfg.dynamic_sampling
    )
    logit = {k: math.log(p / (1 - p)) for k, p in rates.items()}
    rate = lambda task: 1 / (1 + math.exp(-logit.get(template_key(task), -4.6)))  # noqa: E731
    out, version, now, gen_free, seq = Result(), 0, 0.0, 0.0, 0
    flight: list = []  # (done_s, seq, ticket, task, trajectories)
    ready: list = []
    step_end: tuple[float, list] | None = None  # (end_s, trained template keys)
    while True:
        while len(flight) < cfg.groups_in_flight:
            task = (await pool.next_task()).task
            ticket = await admission.try_admit(f"g{seq}")
            if ticket is None:
                await pool.put_back(task.task_id)
                break
            p = rate(task)
            out.groups_generated += 1
            out.episodes_low_rate += cfg.group_size * (p < 0.1)
            gen_free = max(now, gen_free) + cfg.group_size / cfg.episodes_per_s
            rewards = [float(rng.random() < p) for _ in range(cfg.group_size)]
            trajs = [
                make_trajectory(f"g{seq}", r, trajectory_id=f"g{seq}-{i}-a0",
                                group_size=cfg.group_size, version=version)
                for i, r in enumerate(rewards)
            ]  # fmt: skip
            heapq.heappush(flight, (gen_free, seq, ticket, task, trajs))
            seq += 1
        next_group = flight[0][0] if flight else math.inf
        next_step = step_end[0] if step_end else math.inf
        now = min(next_group, next_step)
        if now > cfg.budget_s:
            break
        if next_step <= next_group:
            version += 1
            await redis.set(POLICY_VERSION_KEY, version)
            for key in step_end[1]:
                logit[key] = logit.get(key, -4.6) + cfg.learning_logit
            step_end = None
        else:
            _, _, ticket, task, trajs = heapq.heappop(flight)
            await admission.finish(ticket, usable=len(trajs))
            for t in trajs:
                await admission.member_scored(t)
                if steering is not None:
                    await steering.record(task, t.reward >= 1.0)
                assembler.add(t.trajectory_id, t, version)
            await pool.done(task.task_id)
            ready += [(g, template_key(task)) for g in assembler.pop_ready(version)]
        if step_end is None and sum(g.counts for g, _ in ready) >= cfg.groups_per_step:
            taken, counted = [], 0
            while counted < cfg.groups_per_step:
                taken.append(ready.pop(0))
                counted += taken[-1][0].counts
            trained = []
            for g, key in taken:
                g = assembler.recheck(g, version)
                out.groups_stale += not g.trainable and g.counts
                keys = [reward_key(m.trajectory.training_reward, True) for m in g.members]
                if g.trainable and has_variance(keys):
                    trained.append((key, len(g.members)))
            out.steps += 1
            out.steps_trained += bool(trained)
            out.groups_trained += len(trained)
            duration = cfg.learner_s_per_trajectory * sum(n for _, n in trained)
            step_end = (now + duration, [k for k, _ in trained])
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    return out


CONFIGS = {
    "baseline": SimConfig(),
    "dynamic sampling": SimConfig(dynamic_sampling=True),
    "pass-rate steering": SimConfig(steering=True),
    "dynamic + steering": SimConfig(dynamic_sampling=True, steering=True),
    "dynamic + steering, B = 2": SimConfig(dynamic_sampling=True, steering=True, groups_per_step=2),
}


async def run(seeds: int, **overrides) -> dict[str, list[Result]]:
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-dynamic-"))).start()
    redis = connect(server.url)
    tasks, rates = training_pool(), base_rates()
    results = {}
    try:
        for name, cfg in CONFIGS.items():
            results[name] = [
                await simulate(redis, replace(cfg, seed=s, **overrides), tasks, rates)
                for s in range(seeds)
            ]  # fmt: skip
    finally:
        await redis.aclose()
        server.stop()
    return results


def table(results: dict[str, list[Result]]) -> str:
    rows = [
        "| setting | steps | steps that trained | groups trained / step | groups trained "
        "| episodes / trained group | stale groups | episodes on < 10 % templates |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = statistics.mean(r.groups_trained for r in results["baseline"]) or 1
    for name, rs in results.items():
        mean = lambda f: statistics.mean(f(r) for r in rs)  # noqa: E731
        trained = mean(lambda r: r.groups_trained)
        rows.append(
            f"| {name} | {mean(lambda r: r.steps):.1f} "
            f"| {100 * mean(lambda r: r.steps_trained / max(r.steps, 1)):.0f}% "
            f"| {mean(lambda r: r.groups_trained / max(r.steps, 1)):.2f} "
            f"| {trained:.1f} ({trained / base:.2f}x) "
            f"| {mean(lambda r: 8 * r.groups_generated / max(r.groups_trained, 1)):.0f} "
            f"| {mean(lambda r: r.groups_stale):.1f} "
            f"| {100 * mean(lambda r: r.episodes_low_rate / max(8 * r.groups_generated, 1)):.0f}% |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="simulated runs per setting")
    parser.add_argument(
        "--learning-logit", type=float, default=0.0, help="logit gain per trained group (toy)"
    )
    parser.add_argument(
        "--steering-window", type=int, default=32, help="episodes of a template's pass rate"
    )
    parser.add_argument(
        "--minutes", type=float, default=20.0, help="simulated training time per run"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 seed, 2 simulated minutes (a smoke run: seconds)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.minutes = 1, 2.0
    overrides = {
        "learning_logit": args.learning_logit,
        "steering_window": args.steering_window,
        "budget_s": 60 * args.minutes,
    }
    results = asyncio.run(run(args.seeds, **overrides))
    print(f"seeds {args.seeds}, {overrides}, {args.minutes:g} min simulated\n")
    print(table(results))


if __name__ == "__main__":
    main()
