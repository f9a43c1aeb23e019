"""Task sources from plug-ins (entry point group `shellrl.tasksets`; docs/plugins.md).

A task-source plug-in is a callable

    source(split: str | None, seed: int) -> Iterable[dict | Task]

returning tasks in the JSON form of the task files (or `shellrl.v1.Task` messages); `split`
None means every split it has, `seed` is the job's task seed. Every task is validated by
`shellrl.contract.task_from_json` (a bad one raises TaskValidationError naming the set, the
task's index and the field); `load_taskset` keeps those of the split asked for.
"""

from __future__ import annotations

from shellrl.contract import Task, TaskValidationError, task_from_json, task_to_json
from shellrl.plugins import TASKSETS, load


def plugin_taskset(
    name: str, split: str | None, seed: int, reserved: tuple[str, ...]
) -> list[Task] | None:
    """The validated tasks of plug-in task set `name`; None when no plug-in provides it.
    Raises PluginError (cannot be loaded, or shadows a built-in set) and TaskValidationError."""
    source = load(TASKSETS, name, reserved=reserved)
    if source is None:
        return None
    tasks = []
    for i, item in enumerate(source(split, seed)):
        obj = task_to_json(item) if isinstance(item, Task) else item
        try:
            tasks.append(task_from_json(obj))
        except TaskValidationError as exc:
            raise TaskValidationError(f"{name}[{i}].{exc.field}", exc.message) from None
    return tasks
