"""Running check types from plug-ins (`Check.plugin`; entry point group `shellrl.checks`: the
protocol is in shellrl/contract/plugin_checks.py, the guide in docs/plugins.md).

Outcomes as for the built-in checks (checks.py): the plug-in's `run` returns (passed, detail);
anything that keeps it from deciding is a `CheckInfraError` (FAILURE_INFRA_VERIFIER, never a
reward of 0): the plug-in is not installed in this verifier or cannot be imported, its `run`
raised, or it ran past the check's budget plus 10 s. A synchronous `run` runs in a worker thread.

`plugin_check_types` describes the installed ones for `GET /v1/checks`.
"""

from __future__ import annotations

import asyncio
import inspect
import json

from services.verifier.workspace_checks import CheckInfraError, Workspace
from shellrl.contract import CHECK_TYPES
from shellrl.plugins import CHECKS, PluginError, available, load
from shellrl.v1.task_pb2 import PluginCheck


async def run_plugin_check(
    spec: PluginCheck, answer: str | None, workspace: Workspace | None, timeout_s: float
) -> tuple[bool, str]:
    """(passed, detail) of one plug-in check. Raises CheckInfraError (see the module docstring)."""
    try:
        plugin = load(CHECKS, spec.type, reserved=tuple(CHECK_TYPES))
    except PluginError as exc:
        raise CheckInfraError(str(exc)) from None
    if plugin is None:
        raise CheckInfraError(f"check type {spec.type!r}: no plug-in provides it in this verifier")
    params = json.loads(spec.params_json or "{}")
    run = plugin.run
    call = (
        run(params, answer, workspace, timeout_s)
        if inspect.iscoroutinefunction(run)
        else asyncio.to_thread(run, params, answer, workspace, timeout_s)
    )
    try:
        passed, detail = await asyncio.wait_for(call, timeout_s + 10)
    except TimeoutError:
        raise CheckInfraError(f"{spec.type}: the plug-in ran past the check's budget") from None
    except CheckInfraError:
        raise
    except Exception as exc:
        raise CheckInfraError(
            f"{spec.type}: the plug-in raised {type(exc).__name__}: {exc}"
        ) from exc
    return bool(passed), str(detail)


def plugin_check_types() -> list[dict]:
    """The check types that plug-ins add in this verifier, by name, for `GET /v1/checks`: each
    {"type", "source": the distribution that declares the entry point (null when unknown),
    "version": its version, "entry_point": "module:attr", "description": the first line of the
    plug-in's docstring, "parameters": its optional `PARAMETERS` dict {name: "type = default"}},
    or, for one that cannot be loaded or shadows a built-in type, "error" (a string) in place of
    description and parameters. Never raises."""
    out = []
    for name, ep in sorted(available(CHECKS).items()):
        dist = getattr(ep, "dist", None)
        entry: dict = {
            "type": name,
            "source": dist.name if dist is not None else None,
            "version": dist.version if dist is not None else None,
            "entry_point": ep.value,
        }
        try:
            plugin = load(CHECKS, name, reserved=tuple(CHECK_TYPES))
        except PluginError as exc:
            out.append({**entry, "error": str(exc)})
            continue
        doc = inspect.getdoc(plugin) or ""
        params = getattr(plugin, "PARAMETERS", None)
        out.append(
            {
                **entry,
                "description": doc.splitlines()[0] if doc else "",
                "parameters": {str(k): str(v) for k, v in params.items()}
                if isinstance(params, dict)
                else {},
            }
        )
    return out
