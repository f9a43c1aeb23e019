"""The main job's experiment tracking (shellrl/tracking.py): its run (`open_tracker`: the job's
options as its config), every service's resolved settings (`log_service_configs`), and each
evaluation's success with its 95% interval, per-template table and a table of sampled episodes
(`log_evaluations`: task, outcome, reward, the prompt's end, the actions and tool outputs).
"""

from __future__ import annotations

from itertools import chain, zip_longest

import httpx

from shellrl.tracking import NullTracker

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def open_tracker(cfg):
    """The job's tracker (shellrl/tracking.py; run `job` under <state>/tracking, beside the
    learner's, one run name for both) with the job's options logged as its config: the tracker
    and <state>/tracking/job/config.json. [env] values whose names hold a secret word are
    logged as '***'."""
    from dataclasses import asdict

    from shellrl.tracking import TrackingConfig, create_tracker

    tracker = create_tracker(TrackingConfig(backend=cfg.tracker), "job", cfg.state_dir / "tracking")
    config = asdict(cfg)
    config["extra_env"] = {
        name: "***" if any(w in name.upper() for w in SECRET_WORDS) else value
        for name, value in cfg.extra_env.items()
    }
    tracker.log_config(config)
    return tracker


def log_service_configs(tracker, urls: dict[str, str], headers: dict) -> None:
    """Each service's resolved settings (its GET /v1/config) to the job's tracker, as
    "config/<service>" (<state>/tracking/job/config/<service>.json); a service that does not
    answer is left out."""
    for service, url in urls.items():
        try:
            r = httpx.get(f"{url.rstrip('/')}/v1/config", headers=headers, timeout=10)
            r.raise_for_status()
        except httpx.HTTPError:
            continue
        tracker.log_config(r.json(), name=f"config/{service}")


SAMPLE_COLUMNS = ("task_id", "outcome", "reward", "turns", "prompt", "transcript")


def eval_samples(
    client: httpx.Client | None, view: dict, rows: int = 4, max_chars: int = 2000
) -> list[tuple]:
    """Up to `rows` episodes of an evaluation view (its `results`), successes and the rest taken
    in turn, each fetched from the gateway (`client`: its base URL and token) as GET
    /v1/trajectories/{id}?skip_special_tokens=true: SAMPLE_COLUMNS, the prompt's last and the
    transcript's first `max_chars` characters, decoded without the chat template's special
    tokens. An episode the gateway cannot show is left out; [] without a client."""
    if client is None:
        return []
    found = [r for r in view.get("results") or [] if r.get("trajectory_id")]
    successes = [r for r in found if r.get("outcome") == "success"]
    others = [r for r in found if r.get("outcome") != "success"]
    picked = [r for r in chain(*zip_longest(successes, others)) if r is not None][:rows]
    out = []
    for r in picked:
        try:
            answer = client.get(
                f"/v1/trajectories/{r['trajectory_id']}",
                params={"skip_special_tokens": "true"},  # no chat-template markers in the table
                timeout=30,
            )
            answer.raise_for_status()
        except httpx.HTTPError:
            continue
        t = answer.json()
        transcript = "".join(s["text"] for turn in t["turns"] for s in turn["segments"])
        prompt = t["prompt"]["text"][-max_chars:]
        reward = "-" if t.get("reward") is None else t["reward"]
        out.append(
            (r["task_id"], r["outcome"], reward, t["num_turns"], prompt, transcript[:max_chars])
        )
    return out


def log_evaluations(
    tracker, results: dict[str, dict], tasks_by_id: dict, client: httpx.Client | None = None
) -> None:
    """Success with n and its 95% interval per eval set, a per-template table and, given the
    gateway's `client`, a table of sampled episodes (`eval_samples`), at the policy version the
    evaluation ran on."""
    from cli.report import per_template
    from cli.report_plots import eval_bar

    for name, view in results.items():
        rate, n, lo, hi = eval_bar(view)
        step = max(view.get("policy_versions_seen") or [0])
        tracker.log_metrics(
            {
                f"eval/{name}/success_rate": rate,
                f"eval/{name}/success_low": lo,
                f"eval/{name}/success_high": hi,
                f"eval/{name}/episodes": n,
            },
            step,
        )
        rows = [
            [t, s, e, round(s / e, 4) if e else None]
            for t, (s, e) in sorted(per_template(view, tasks_by_id).items())
        ]
        columns = ["template", "successes", "episodes", "success_rate"]
        tracker.log_table(f"eval/{name}/per_template", columns, rows, step)
        if isinstance(tracker, NullTracker):  # no tracker: no transcripts to fetch
            continue
        if samples := eval_samples(client, view):
            tracker.log_table(f"eval/{name}/samples", SAMPLE_COLUMNS, samples, step)
