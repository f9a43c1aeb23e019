"""Plug-ins: a user's package adds a check type, a reward component or a task source through
Python entry points, without editing shellrl (docs/plugins.md; a worked example in
examples/shellrl-plugin-example/).

  group              entry point name       what it loads                  who calls it
  shellrl.checks     the check `type`       CheckPlugin: `run` (+ `validate`) contract (validate),
                                                                            verifier (run)
  shellrl.rewards    the component name     RewardPlugin: `__call__`, `weight` verifier (rewards.py)
  shellrl.tasksets   the task set name      `load(split, seed) -> tasks`   tasksets.load_taskset

Entry points are read once per process (`importlib.metadata.entry_points`) and each one is
imported the first time it is used; install the package into every image that runs the part
(a check type: gateway and verifier; a reward component: verifier; a task set: the CLI).
A name that shadows a built-in (a check type, a reward component, a task set of shellrl) is
refused with `PluginError`, as is an entry point that cannot be imported.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import EntryPoint, entry_points
from typing import Any

log = logging.getLogger(__name__)

CHECKS, REWARDS, TASKSETS = "shellrl.checks", "shellrl.rewards", "shellrl.tasksets"
GROUPS = (CHECKS, REWARDS, TASKSETS)


class PluginError(Exception):
    """A plug-in that cannot be used: not importable, or a name shellrl already uses."""


@functools.cache
def available(group: str) -> dict[str, EntryPoint]:
    """{name: entry point} of `group` (one of GROUPS) in the installed distributions; read once
    per process (call `available.cache_clear()` after installing one at run time)."""
    if group not in GROUPS:
        raise ValueError(f"unknown plug-in group {group!r}; one of {GROUPS}")
    return {ep.name: ep for ep in entry_points(group=group)}


def names(group: str) -> list[str]:
    return sorted(available(group))


def load(group: str, name: str, *, reserved: tuple[str, ...] = ()) -> Any | None:
    """The object entry point `name` of `group` points at; None when no package provides it.
    Raises PluginError when `name` is in `reserved` (a built-in name) or the import fails."""
    ep = available(group).get(name)
    if ep is None:
        return None
    return _load(group, ep.name, ep.value, reserved)


@functools.cache
def _load(group: str, name: str, value: str, reserved: tuple[str, ...]) -> Any:
    if name in reserved:
        raise PluginError(f"{group} plug-in {name!r} ({value}) shadows a built-in name")
    try:
        obj = EntryPoint(name, value, group).load()
    except Exception as exc:
        raise PluginError(f"{group} plug-in {name!r} ({value}) cannot be loaded: {exc}") from exc
    log.info("plug-in loaded", extra={"group": group, "plugin": name, "target": value})
    return obj


def load_all(group: str, *, reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """{name: object} of every entry point of `group`, sorted by name (PluginError as `load`)."""
    return {name: load(group, name, reserved=reserved) for name in names(group)}
