"""Loader of the public task set shipped as package data (tasksets/data/).

`agentbench_os.jsonl`: 110 training tasks from AgentBench's OS-interaction set (THUDM/AgentBench,
Apache-2.0), converted by the project with exact check semantics; see data/README.md for the
attribution and ../shared/tasks/README.md for how each label was verified. Tasks carry `env`
(e.g. HOME = "<workspace>", substituted by the sandbox).
"""

from __future__ import annotations

from importlib import resources

from shellrl.contract import Task, iter_tasks_jsonl

PUBLIC_SETS = {"agentbench_os": "agentbench_os.jsonl"}


def load_public(name: str = "agentbench_os") -> list[Task]:
    """All tasks of a public set. Raises KeyError for an unknown name and TaskValidationError
    (with the line number) for a bad record."""
    if name not in PUBLIC_SETS:
        raise KeyError(f"unknown public task set {name!r}; one of {sorted(PUBLIC_SETS)}")
    text = (
        resources.files("tasksets").joinpath("data", PUBLIC_SETS[name]).read_text(encoding="utf-8")
    )
    return list(iter_tasks_jsonl(text.splitlines()))
