"""Check types from plug-ins (entry point group `shellrl.checks`, shellrl/plugins.py) in the
task contract: their JSON form `{"type": "<plug-in name>", <params>..., "timeout_s"?}` maps to
`Check.plugin` (`PluginCheck`: the type and the other fields as JSON, keys sorted, so the same
check always has the same bytes and task digests stay stable).

A check plug-in is an object (a module, a class, an instance) with

    run(params: dict, answer: str | None, workspace, timeout_s: float) -> (passed, detail)
        may be a coroutine function; `workspace` is the verifier's Workspace (None when the
        episode has no sandbox session; services/verifier/workspace_checks.py)
    validate(params: dict) -> None          optional; raises ValueError (the check is named) or
                                            TaskValidationError(param, message) (that param is)
    PARAMETERS: dict[str, str]              optional; {name: "type = default"}, listed by the
                                            verifier's GET /v1/checks

`run` is the verifier's business (services/verifier/checks.py); this module only validates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from shellrl.contract.errors import TaskValidationError
from shellrl.plugins import CHECKS, PluginError, load
from shellrl.v1.task_pb2 import Check, PluginCheck


def plugin_check_from_json(
    kind: str, obj: Mapping, field: str, reserved: tuple[str, ...]
) -> Check | None:
    """The Check of plug-in type `kind` (timeout_s left 0 for the caller), or None when no
    installed plug-in provides `kind`. reserved: the built-in check types, which no plug-in may
    shadow. Raises TaskValidationError naming the field when the plug-in refuses the parameters,
    they are not JSON, or the plug-in cannot be loaded."""
    try:
        plugin = load(CHECKS, kind, reserved=reserved)
    except PluginError as exc:
        raise TaskValidationError(f"{field}.type", str(exc)) from None
    if plugin is None:
        return None
    params = {k: v for k, v in obj.items() if k not in ("type", "timeout_s")}
    validate = getattr(plugin, "validate", None)
    if validate is not None:
        try:
            validate(dict(params))
        except TaskValidationError as exc:
            raise TaskValidationError(f"{field}.{exc.field}", f"{kind}: {exc.message}") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise TaskValidationError(field, f"{kind}: {exc}") from None
    try:
        params_json = json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TaskValidationError(field, f"{kind}: parameters are not JSON: {exc}") from None
    return Check(plugin=PluginCheck(type=kind, params_json=params_json))
