"""Contrast sets in a real sandbox (tasksets/contrast.py, issue 33 item 2): in the workspace of
each task (its setup run by the sandbox), every quantity's reference command counts the file; the
verifier's own checks pass the asked quantity's count and fail each other quantity's count of the
same file, so answering another quantity of the file earns reward 0."""

from __future__ import annotations

import asyncio

import pytest

from services.verifier.parts import build_verifier
from services.verifier.settings import VerifierSettings
from shellrl.clients.sandbox import SandboxClient
from tasksets.contrast import QUANTITIES, contrast_tasks

pytestmark = pytest.mark.slow


async def test_each_task_rewards_its_quantity_and_no_other_quantity_of_the_file(sandbox_url):
    sandbox = SandboxClient(sandbox_url)
    verifier = build_verifier(
        VerifierSettings(sandbox_url=sandbox_url, worker_enabled=False), sandbox
    )
    tasks = contrast_tasks()
    siblings = {t.task_id: [s for s in tasks if s.setup == t.setup] for t in tasks}
    slots = asyncio.Semaphore(4)

    async def rewards(task) -> dict[str, float]:
        """{sibling template: reward of `task` answered with the sibling's reference output}"""
        async with slots:
            session_id = (await sandbox.create_session(setup=task.setup))["session_id"]
            try:
                out = {}
                for sibling in siblings[task.task_id]:
                    ran = await sandbox.exec(session_id, sibling.reference_solution, timeout_s=30)
                    assert ran.exit_code == 0, (sibling.task_id, ran.stderr)
                    result = await verifier.verify(task, ran.stdout, session_id, [])
                    assert result.scored, result.failure_detail
                    out[sibling.template] = result.reward.reward
                return out
            finally:
                await sandbox.delete(session_id)

    try:
        got = await asyncio.gather(*(rewards(t) for t in tasks))
    finally:
        await sandbox.aclose()
    assert len(got) == len(tasks) == 4 * len({t.setup for t in tasks})
    for task, by_sibling in zip(tasks, got, strict=True):
        assert set(by_sibling) == {f"contrast_{q.name}" for q in QUANTITIES}
        assert by_sibling == {
            name: (1.0 if name == task.template else 0.0) for name in by_sibling
        }, task.task_id
