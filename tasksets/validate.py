"""Validation of task sets against a real sandbox, with the verifier's own check code.

For every task, in two fresh sandbox sessions (each: the task's setup, then):
  1. run the reference solution; its stdout is the answer; verify → must pass (reward 1);
  2. do nothing; submit a plausible wrong answer; verify → must fail (reward 0).
An INFRA failure in either counts as "not validated". Results of tasks that validated are cached
(per task content and VERIFIER_VERSION) in ~/.cache/shellrl/validated-tasks.json, so a second
load of the same set costs nothing.

The checks are those of services.verifier (imported here, not reimplemented): validation and
training can never disagree on what passes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shellrl.contract import Task, split_name, task_to_json

log = logging.getLogger(__name__)

CACHE_PATH = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "shellrl"
    / "validated-tasks.json"
)
REFERENCE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TaskValidation:
    """reference_passed: the reference solution's answer and end state pass every check.
    wrong_failed: a wrong answer on the untouched workspace fails. detail: why not, if not."""

    task_id: str
    source: str
    split: str
    template: str
    reference_passed: bool
    wrong_failed: bool
    detail: str = ""
    duration_ms: float = 0.0
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.reference_passed and self.wrong_failed


def wrong_answer_for(task: Task, known: dict[str, str] | None = None) -> str:
    """A plausible wrong answer: the template's own (`known`, the seeds' WRONG_ANSWERS), else from
    the first answer check (integer: expected + 1; string: expected + " x"); for tasks graded only
    on the workspace, any answer is wrong while the workspace is untouched."""
    from tasksets.seeds import WRONG_ANSWERS

    table = {**WRONG_ANSWERS, **(known or {})}
    if task.task_id in table:
        return table[task.task_id]
    for check in task.checks:
        kind = check.WhichOneof("kind")
        if kind == "answer_integer_equals":
            return str(check.answer_integer_equals.expected + 1)
        if kind == "answer_equals":
            return check.answer_equals.expected.strip() + " x"
        if kind == "answer_matches":
            return "\x00not an answer\x00"
    return "done"


def content_key(task: Task) -> str:
    """sha256 of the task's JSON form and the verifier version (the cache key)."""
    from services.verifier.checks import VERIFIER_VERSION

    body = json.dumps([task_to_json(task), VERIFIER_VERSION], sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


class ValidationCache:
    """Content keys of tasks that validated (JSON file; written atomically)."""

    def __init__(self, path: Path | None = CACHE_PATH) -> None:
        self.path = path
        self.keys: set[str] = set()
        if path is not None and path.exists():
            try:
                self.keys = set(json.loads(path.read_text()))
            except (OSError, ValueError):
                log.warning("ignoring an unreadable validation cache", extra={"path": str(path)})

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self.keys)))
        tmp.replace(self.path)


async def _verify_in_fresh_session(
    sandbox, verifier, task: Task, answer_script: str | None, answer: str | None
):
    """(verification, reference exec result or None) in a new session that is deleted afterwards."""
    session = await sandbox.create_session(setup=task.setup, env=dict(task.env))
    session_id = session["session_id"]
    try:
        ran = None
        if answer_script is not None:
            ran = await sandbox.exec(session_id, answer_script, timeout_s=REFERENCE_TIMEOUT_S)
            answer = ran.stdout
        return await verifier.verify(task, answer, session_id, []), ran
    finally:
        try:
            await sandbox.delete(session_id)
        except Exception:  # noqa: BLE001, S110 (the sandbox's TTL removes it)
            pass


async def validate_task(task: Task, wrong_answer: str, sandbox, verifier) -> TaskValidation:
    """Validate one task (see the module docstring). Never raises."""
    start = time.perf_counter()
    meta = {
        "task_id": task.task_id,
        "source": task.source,
        "split": split_name(task.split),
        "template": task.template,
    }
    if not task.reference_solution:
        return TaskValidation(
            **meta, reference_passed=False, wrong_failed=False, detail="no reference_solution"
        )
    try:
        ref, ran = await _verify_in_fresh_session(
            sandbox, verifier, task, task.reference_solution, None
        )
        wrong, _ = await _verify_in_fresh_session(sandbox, verifier, task, None, wrong_answer)
    except Exception as exc:  # noqa: BLE001 (a task that cannot run does not validate; reported, never raised)
        return TaskValidation(
            **meta,
            reference_passed=False,
            wrong_failed=False,
            detail=f"sandbox: {exc!r}",
            duration_ms=(time.perf_counter() - start) * 1000,
        )
    details = []
    reference_passed = ref.scored and ref.reward.reward == 1.0
    if not reference_passed:
        failed = [c.detail for c in ref.checks if not c.passed]
        details.append(
            f"reference: {ref.failure_detail or failed} (exit {ran.exit_code if ran else '?'}, "
            f"stderr {ran.stderr[-200:] if ran else ''!r})"
        )
    wrong_failed = wrong.scored and wrong.reward.reward == 0.0
    if not wrong_failed:
        details.append(f"wrong answer {wrong_answer!r}: " + (wrong.failure_detail or "passed"))
    return TaskValidation(
        **meta,
        reference_passed=reference_passed,
        wrong_failed=wrong_failed,
        detail="; ".join(details),
        duration_ms=(time.perf_counter() - start) * 1000,
    )


async def validate_tasks(
    tasks: Sequence[Task],
    sandbox_url: str,
    *,
    wrong_answers: dict[str, str] | None = None,
    concurrency: int = 4,
    cache: ValidationCache | None = None,
    api_token: str | None = None,
) -> list[TaskValidation]:
    """Validate `tasks` against the sandbox at `sandbox_url` (its bearer token: `api_token`),
    `concurrency` at a time.

    Tasks whose content key is in `cache` are reported as validated without running; newly
    validated ones are added to it (and saved). Returns one TaskValidation per task, in order.
    """
    from services.verifier.parts import build_verifier
    from services.verifier.settings import VerifierSettings
    from shellrl.clients.sandbox import SandboxClient

    sandbox = SandboxClient(sandbox_url, api_token=api_token)
    verifier = build_verifier(
        VerifierSettings(sandbox_url=sandbox_url, worker_enabled=False), sandbox
    )
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> TaskValidation:
        key = content_key(task)
        if cache is not None and key in cache.keys:
            return TaskValidation(
                task.task_id,
                task.source,
                split_name(task.split),
                task.template,
                True,
                True,
                cached=True,
            )
        async with slots:
            result = await validate_task(
                task, wrong_answer_for(task, wrong_answers), sandbox, verifier
            )
        if result.ok and cache is not None:
            cache.keys.add(key)
        return result

    try:
        results = await asyncio.gather(*(one(t) for t in tasks))
    finally:
        await sandbox.aclose()
        if cache is not None:
            cache.save()
    return list(results)


def load_validated(
    name: str,
    split: str | None,
    sandbox_url: str,
    *,
    seed: int = 0,
    cache: ValidationCache | None = None,
) -> tuple[list[Task], list[TaskValidation]]:
    """`load_taskset(name, split)` keeping only the tasks that validate; also returns the
    failures (so that a caller can report them). Blocking; runs its own event loop."""
    from tasksets import load_taskset

    tasks = load_taskset(name, split, seed=seed)
    results = asyncio.run(
        validate_tasks(
            tasks,
            sandbox_url,
            wrong_answers=generated_wrong_answers(tasks, seed),
            cache=cache if cache is not None else ValidationCache(),
        )
    )
    ok = {r.task_id for r in results if r.ok}
    return [t for t in tasks if t.task_id in ok], [r for r in results if not r.ok]


def generated_wrong_answers(tasks: Iterable[Task], seed: int = 0) -> dict[str, str]:
    """The templates' own wrong answers for the generated tasks among `tasks`."""
    from tasksets.generator import SOURCE, generate_with_wrong_answers

    splits = {split_name(t.split) for t in tasks if t.source == SOURCE}
    return {
        task.task_id: wrong
        for s in splits
        for task, wrong in generate_with_wrong_answers(s, seed=seed)
    }
