"""The JSON Schema of a task in JSON form (what `tasks.task_from_json` accepts), for the OpenAPI
documents of the rollout gateway (`POST /v1/tasks`) and the verifier (`POST /v1/verify`).

Built from the same sources as the validator: each check type's fields from its proto message
(CHECK_TYPES; proto3 scalar types as JSON types with their ranges), REQUIRED_CHECK_FIELDS and
LIMITS. What a schema cannot say the validator still checks, answering 422 naming the field: one
field per oneof (`substring` or `regex`, not both), a regex that compiles, a sha256 of 64 hex
digits, a relative path, the size of `env` in bytes, no lone UTF-16 surrogates.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from shellrl.contract.tasks import CHECK_TYPES, LIMITS, REQUIRED_CHECK_FIELDS, SPLIT_NAMES

_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_INT64: {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
}


_FORMATS: dict[str, dict[str, Any]] = {
    "sha256": {"pattern": "^[0-9a-f]{64}$"},
    "path": {"pattern": "^[^/\\x00][^\\x00]*$", "description": "relative to the workspace"},
    "pattern": {"maxLength": LIMITS["pattern_chars"], "description": "a Python regex"},
    "regex": {"maxLength": LIMITS["pattern_chars"], "description": "a Python regex"},
}
"""Check fields that need more than their proto type (tasks._validate_check)."""


def check_schema_name(kind: str) -> str:
    """`file_contains` -> `FileContainsCheck` (the component name of that check type)."""
    return "".join(part.title() for part in kind.split("_")) + "Check"


def task_json_schema(ref_template: str = "#/$defs/{model}") -> dict[str, Any]:
    """JSON Schema of one task; its check types under `$defs` (`ref_template` formats the
    references, e.g. "#/components/schemas/{model}" for an OpenAPI document)."""
    defs: dict[str, Any] = {}
    for kind, message in CHECK_TYPES.items():
        properties: dict[str, Any] = {
            "type": {"const": kind},
            "timeout_s": {
                "type": ["number", "null"],
                "minimum": 0,
                "maximum": 3600,
                "description": "0 or null: the verifier's default",
            },
        }
        for field in message.DESCRIPTOR.fields:
            properties[field.name] = {**_SCALARS[field.type], **_FORMATS.get(field.name, {})}
        defs[check_schema_name(kind)] = {
            "type": "object",
            "properties": properties,
            "required": ["type", *REQUIRED_CHECK_FIELDS[kind]],
            "additionalProperties": False,
        }
        for oneof in message.DESCRIPTOR.oneofs:  # exactly one of its fields
            defs[check_schema_name(kind)]["oneOf"] = [{"required": [f.name]} for f in oneof.fields]
    check = {"oneOf": [{"$ref": ref_template.format(model=name)} for name in defs]}
    defs["Check"] = {**check, "discriminator": {"propertyName": "type"}}
    one_check = {"$ref": ref_template.format(model="Check")}
    checks = {
        "oneOf": [
            one_check,
            {"type": "array", "items": one_check, "minItems": 1, "maxItems": LIMITS["checks"]},
        ]
    }
    text = {"type": "string"}
    return {
        "$defs": defs,
        "title": "Task",
        "type": "object",
        "properties": {
            "task_id": {
                "type": ["string", "null"],
                "pattern": r"^([A-Za-z0-9][A-Za-z0-9._:-]*)?$",
                "maxLength": LIMITS["task_id_chars"],
                "description": "Default (absent, null or empty): task-<content hash>.",
            },
            "instruction": {
                "type": "string",
                "pattern": r"\S",
                "maxLength": LIMITS["instruction_chars"],
            },
            "setup": {
                "type": "string",
                "pattern": "^[^\\x00]*$",
                "maxLength": LIMITS["setup_chars"],
                "description": "bash script run in the empty workspace",
            },
            "env": {
                "type": ["object", "null"],
                "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                "additionalProperties": {"type": "string", "pattern": "^[^\\x00]*$"},
                "description": 'Extra environment; "<workspace>" is substituted; at most '
                f"{LIMITS['env_bytes']} bytes",
            },
            "check": checks,
            "checks": checks,
            "split": {"enum": [*sorted(SPLIT_NAMES), None], "description": "null: train"},
            "tags": {"type": ["array", "null"], "items": text, "maxItems": LIMITS["tags"]},
            "max_turns": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": LIMITS["max_turns"],
                "description": "0 or null: the gateway's default",
            },
            "source": text,
            "reference_solution": text,
            "template": text,
            "origin": {"description": "provenance; accepted and dropped"},
            "independent_solution": {"description": "provenance; accepted and dropped"},
            "label_cross_checked": {"description": "provenance; accepted and dropped"},
        },
        "required": ["instruction"],
        "oneOf": [{"required": ["check"]}, {"required": ["checks"]}],
        "additionalProperties": False,
    }


def task_schema_components(ref_template: str) -> dict[str, Any]:
    """{"Task": ..., "Check": ..., "<Kind>Check": ...}: the schemas to put under an OpenAPI
    document's components, referenced as `ref_template.format(model="Task")`."""
    task = task_json_schema(ref_template)
    return {**task.pop("$defs"), "Task": task}
