"""What a run's policy answers instead (issue 33 item 1): for the counting templates of the eval
sets, which quantity of the task's file each recorded answer equals (its lines, words or bytes,
as `wc -l`, `wc -w`, `wc -c` count them), before and after training.

The eval tasks are rebuilt from the job's task seed (cli/job_tasks.eval_sets of the default
JobConfig, the sets every recorded run evaluated), each setup script runs in a fresh temporary
directory, and the one file it writes is counted; an answer matching none of the three is
`other`. Reads only evaluations.json (per-episode `answer`), so it works on any recorded run.

    .venv/bin/python -m benchmarks.answer_quantities docs/runs/main-job \
        docs/runs/gpu-2026-12-05-graphs/s{0,1,2} [--templates count_lines,file_size_bytes]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from cli.eval_stats import template_of
from cli.job_config import JobConfig
from cli.job_tasks import eval_sets

QUANTITIES = ("lines", "words", "bytes")
COUNT = "f=$(find . -type f | head -1); echo $(wc -l < $f) $(wc -w < $f) $(wc -c < $f)"


def file_counts(task) -> dict[str, int]:
    """{lines, words, bytes} of the file the task's setup writes (its first, sorted by find)."""
    with tempfile.TemporaryDirectory() as d:
        env = {
            **os.environ,
            "HOME": d,
            **{k: v.replace("<workspace>", d) for k, v in task.env.items()},
        }
        subprocess.run(["bash", "-c", task.setup], cwd=d, env=env, capture_output=True, timeout=30)
        out = subprocess.run(["bash", "-c", COUNT], cwd=d, capture_output=True, text=True)
    return dict(zip(QUANTITIES, map(int, out.stdout.split())))


def quantities(run: Path, templates: list[str], tasks: dict) -> dict[str, dict[str, Counter]]:
    """{when: {template: Counter(quantity the answer equals)}} of one run's evaluations."""
    evaluations = json.loads((run / "evaluations.json").read_text())
    out: dict[str, dict[str, Counter]] = {}
    for when in ("before", "after"):
        for view in evaluations[when].values():
            for r in view.get("results", []):
                task = tasks.get(r["task_id"].removeprefix("eval-"))
                template = template_of(r["task_id"])
                if task is None or template not in templates:
                    continue
                counts = file_counts(task)
                answer = (r.get("answer") or "").strip()
                hit = next((q for q in QUANTITIES if answer == str(counts[q])), "other")
                out.setdefault(when, {}).setdefault(template, Counter())[hit] += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--templates", default="count_lines,file_size_bytes")
    args = parser.parse_args()
    templates = args.templates.split(",")
    tasks = {t.task_id: t for ts in eval_sets(JobConfig()).values() for t in ts}
    print("| run | evaluation | template | answers | = lines | = words | = bytes | other |")
    print("|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        for when, by_template in quantities(run, templates, tasks).items():
            for template in templates:
                c = by_template.get(template, Counter())
                cells = " | ".join(str(c[q]) for q in (*QUANTITIES, "other"))
                print(f"| {run} | {when} | {template} | {sum(c.values())} | {cells} |")


if __name__ == "__main__":
    main()
