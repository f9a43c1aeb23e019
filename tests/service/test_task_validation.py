"""Reference solutions pass and wrong answers fail in a real sandbox, for a sample of every task set:
the four seeds, one generated task per template (all 33), and 8 AgentBench OS tasks. (The whole
set, 626 tasks, is `python -m tasksets validate --start-sandbox`; see BENCHMARKS.md.)"""

from __future__ import annotations

import random

import pytest

from tasksets import load_taskset
from tasksets.generator import TEMPLATES
from tasksets.validate import generated_wrong_answers, validate_tasks

pytestmark = pytest.mark.slow


def sample() -> list:
    generated = [
        t for split in ("train", "eval_id", "eval_ood") for t in load_taskset("generated", split)
    ]
    one_per_template = list({t.template: t for t in reversed(generated)}.values())
    assert len(one_per_template) == len(TEMPLATES)
    public = random.Random(0).sample(load_taskset("agentbench_os"), 8)
    return load_taskset("seeds") + one_per_template + public


async def test_reference_solutions_pass_and_wrong_answers_fail_in_a_real_sandbox(sandbox_url):
    tasks = sample()
    results = await validate_tasks(
        tasks, sandbox_url, wrong_answers=generated_wrong_answers(tasks), concurrency=4, cache=None
    )
    failures = [(r.task_id, r.detail) for r in results if not r.ok]
    assert not failures
    assert len(results) == 4 + len(TEMPLATES) + 8


async def test_validation_catches_a_wrong_label_and_a_check_that_accepts_anything(sandbox_url):
    from shellrl.contract import task_from_json

    wrong_label = task_from_json(
        {
            "task_id": "bad-label",
            "instruction": "count",
            "setup": "seq 3 > f",
            "check": {"type": "answer_integer_equals", "expected": 4},
            "reference_solution": "wc -l < f",
        }
    )
    accepts_anything = task_from_json(
        {
            "task_id": "bad-check",
            "instruction": "say hi",
            "setup": "",
            "check": {"type": "answer_matches", "pattern": "(?s).*"},
            "reference_solution": "echo hi",
        }
    )
    results = {
        r.task_id: r
        for r in await validate_tasks([wrong_label, accepts_anything], sandbox_url, cache=None)
    }
    assert not results["bad-label"].reference_passed and results["bad-label"].wrong_failed
    assert results["bad-check"].reference_passed and not results["bad-check"].wrong_failed
