"""Pass rates of the base policy per task template, at the training temperature: which templates can
GRPO learn from at all?

A group of G episodes teaches nothing when its rewards are all equal, so a template the policy solves
with probability p gives a trainable group with probability 1 - p^G - (1-p)^G (G = 8: 0 at p = 0,
0.57 at p = 0.1, 0.99 at p = 0.5). `../shared/reference/feasibility.md` recommends training on tasks the
base model solves 10-60 % of the time, "e.g. by measuring pass rates first": this module measures them
on the running stack (one evaluation at the training sampling, `episodes_per_task` episodes of each of
`tasks_per_template` train instances per template); `select_templates` gives the band [5 %, 75 %].
The main job's curriculum (cli/main_job.py) was chosen from these files and the training runs.

    shellrl pass-rates [--temperature 1.0] [--tasks-per-template 4] [--episodes-per-task 4] [--templates a,b]
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx

from cli.polling import poll_until

# the band of T=1 pass rates the curriculum keeps (inclusive). The low end is below feasibility.md's 10 %
# because with G = 8 a 5 % template still gives a trainable group 34 % of the time.
MIN_PASS_RATE = 0.05
MAX_PASS_RATE = 0.75


@dataclass(frozen=True)
class TemplateRate:
    template: str
    successes: int
    episodes: int

    @property
    def rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    def trainable_group_probability(self, group_size: int) -> float:
        """P(a group of `group_size` i.i.d. episodes has reward variance) = 1 - p^G - (1-p)^G."""
        p = self.rate
        return 1.0 - p**group_size - (1.0 - p) ** group_size


def select_templates(
    rates: list[TemplateRate], lo: float = MIN_PASS_RATE, hi: float = MAX_PASS_RATE
) -> list[str]:
    """Templates whose measured pass rate lies in [lo, hi], in the order given."""
    return [r.template for r in rates if lo <= r.rate <= hi]


def rates_from_view(view: dict, template_of: dict[str, str]) -> list[TemplateRate]:
    """Per-template successes/episodes from an evaluation view (GET /v1/evaluations/{id}); episodes
    without a score (INFRA) are left out."""
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in view.get("results", []):
        if r.get("reward") is None:
            continue
        t = template_of.get(r["task_id"], "?")
        acc[t][0] += int(r.get("outcome") == "success")
        acc[t][1] += 1
    return [TemplateRate(t, s, n) for t, (s, n) in sorted(acc.items())]


def load(path: Path) -> list[TemplateRate]:
    data = json.loads(Path(path).read_text())
    return [TemplateRate(r["template"], r["successes"], r["episodes"]) for r in data["templates"]]


def measure(
    rollout_url: str,
    *,
    tasks_per_template: int,
    episodes_per_task: int,
    temperature: float,
    max_new_tokens: int,
    templates: tuple[str, ...] | None = None,
    seed: int = 0,
    poll_s: float = 2.0,
    headers: dict | None = None,
    timeout_s: float = 3600.0,
) -> tuple[list[TemplateRate], dict]:
    """Submit `tasks_per_template` train instances of every generated train template (or of
    `templates`) as eval copies, never in the training pool, and evaluate them at `temperature`.
    `headers`: the stack's `Authorization` (default: `cli.stack_config.api_headers()`).
    Returns the rates and the raw evaluation view. Raises TimeoutError naming the evaluation and
    its progress when it has not ended (done, failed or cancelled) within `timeout_s` seconds;
    the evaluation stays on the gateway (GET /v1/evaluations/<id>)."""
    from cli.console import cli_console
    from cli.job_stack import submit
    from tasksets import load_taskset

    by_template: dict[str, list] = defaultdict(list)
    for t in load_taskset("generated", "train", seed=seed):
        if templates and t.template not in templates:
            continue
        if len(by_template[t.template]) < tasks_per_template:
            by_template[t.template].append(t)
    tasks = [t for ts in by_template.values() for t in ts]
    from cli.stack_config import api_headers

    client = httpx.Client(
        base_url=rollout_url, headers=api_headers() if headers is None else headers
    )
    ids = submit(client, tasks, eval_copy=True)
    template_of = dict(zip(ids, (t.template for t in tasks)))
    body = {
        "task_ids": ids,
        "greedy": False,
        "episodes_per_task": episodes_per_task,
        "sampling": {"temperature": temperature, "max_new_tokens": max_new_tokens},
    }
    r = client.post("/v1/evaluations", json=body, timeout=60)
    r.raise_for_status()
    eid = r.json()["evaluation_id"]
    t0 = time.monotonic()
    total = len(ids) * episodes_per_task
    last: dict = {}

    def ended() -> dict | None:
        last.update(client.get(f"/v1/evaluations/{eid}", timeout=30).json())
        status.update(
            f"pass rates: {last.get('episodes_done', 0)}/{total} episodes, "
            f"{time.monotonic() - t0:.0f} s"
        )
        return dict(last) if last.get("state") in ("done", "failed", "cancelled") else None

    with cli_console().status("pass rates") as status:
        view = poll_until(ended, timeout_s=timeout_s, interval_s=poll_s)
    if view is None:
        raise TimeoutError(
            f"evaluation {eid} not ended after {timeout_s:g} s: state {last.get('state')!r}, "
            f"{last.get('episodes_done', 0)}/{total} episodes (it stays on the gateway: "
            f"GET /v1/evaluations/{eid})"
        )
    return rates_from_view(view, template_of), view


def write(path: Path, rates: list[TemplateRate], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                **meta,
                "templates": [
                    {
                        "template": r.template,
                        "successes": r.successes,
                        "episodes": r.episodes,
                        "rate": round(r.rate, 4),
                    }
                    for r in rates
                ],
            },
            indent=1,
        )
        + "\n"
    )


def table(rates: list[TemplateRate], group_size: int):
    from rich.table import Table

    t = Table(title="pass rate per template (base policy)")
    for col in (
        "template",
        "successes",
        "episodes",
        "pass rate",
        f"P(trainable group, G={group_size})",
        "curriculum",
    ):
        t.add_column(col)
    keep = set(select_templates(rates))
    for r in sorted(rates, key=lambda r: -r.rate):
        t.add_row(
            r.template,
            str(r.successes),
            str(r.episodes),
            f"{100 * r.rate:.0f}%",
            f"{r.trainable_group_probability(group_size):.2f}",
            "yes" if r.template in keep else "",
        )
    return t
