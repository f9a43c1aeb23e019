"""Tasks in JSON form (the REST API and task files): parse and validate, serialize, JSONL."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import json_format

from shellrl.contract.errors import TaskValidationError
from shellrl.v1.task_pb2 import (
    AnswerEquals,
    AnswerIntegerEquals,
    AnswerMatches,
    Check,
    CommandExitCode,
    CommandOutputEquals,
    FileContains,
    FileExists,
    FileSha256,
    Split,
    Task,
)

# --- tasks in JSON form ---------------------------------------------------------------------
# The JSON form is the one of ../shared/tasks/*.jsonl: a flat check `{"type": ..., params}` (or a
# list of them) under "check". The proto stays the only schema; this maps between the two.

CHECK_TYPES: dict[str, type] = {
    "answer_equals": AnswerEquals,
    "answer_integer_equals": AnswerIntegerEquals,
    "answer_matches": AnswerMatches,
    "file_exists": FileExists,
    "file_contains": FileContains,
    "file_sha256": FileSha256,
    "command_output_equals": CommandOutputEquals,
    "command_exit_code": CommandExitCode,
}

SPLIT_NAMES = {
    "train": Split.SPLIT_TRAIN,
    "eval_id": Split.SPLIT_EVAL_ID,
    "eval_ood": Split.SPLIT_EVAL_OOD,
    "eval": Split.SPLIT_EVAL,
}
_SPLIT_BY_VALUE = {v: k for k, v in SPLIT_NAMES.items()}

MAX_ENV_BYTES = 64 << 10
"""The largest task environment, in bytes: the UTF-8 of every `NAME=value` plus its NUL, as
execve(2) counts it (one string may not exceed 128 KiB there, all of them with the arguments
~2 MiB). The one place this limit is stated: tasks are refused above it (`task_from_json`), and
so is the sandbox's POST /v1/sessions (400 env_too_large), since every program a command starts
inherits the environment."""

LIMITS = {
    "instruction_chars": 16_384,
    "setup_chars": 65_536,
    "checks": 16,
    "tags": 32,
    "max_turns": 64,
    "task_id_chars": 128,
    "pattern_chars": 4096,
    "env_bytes": MAX_ENV_BYTES,
}


def env_bytes(env: Mapping[str, str]) -> int:
    """Size of `env` as execve(2) counts it: UTF-8 bytes of every `NAME=value` plus a NUL. The
    strings must be valid Unicode (no lone surrogates: UnicodeEncodeError)."""
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())


def first_surrogate(text: str) -> int | None:
    """Index of the first lone UTF-16 surrogate (U+D800..U+DFFF) in `text`, None when `text` is
    valid Unicode (encodable as UTF-8). JSON allows `"\\ud800"`; nothing downstream can run it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


_TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


def split_name(split: int) -> str:
    return _SPLIT_BY_VALUE.get(split, "unspecified")


def split_from_name(name: str) -> int:
    try:
        return SPLIT_NAMES[name]
    except KeyError:
        raise TaskValidationError(
            "split", f"unknown split {name!r}; one of {sorted(SPLIT_NAMES)}"
        ) from None


def check_from_json(obj: Any, field: str = "check") -> Check:
    """`{"type": "answer_integer_equals", "expected": 4, "timeout_s"?: 5}` -> Check."""
    if not isinstance(obj, Mapping):
        raise TaskValidationError(field, "must be an object with a 'type'")
    kind = obj.get("type")
    if isinstance(kind, str) and kind not in CHECK_TYPES:
        from shellrl.contract.plugin_checks import plugin_check_from_json

        if (check := plugin_check_from_json(kind, obj, field, tuple(CHECK_TYPES))) is not None:
            check.timeout_s = check_timeout_s(obj, field)
            return check
    if not isinstance(kind, str) or kind not in CHECK_TYPES:
        raise TaskValidationError(
            f"{field}.type", f"unknown check type {kind!r}; one of {sorted(CHECK_TYPES)}"
        )
    params = {k: v for k, v in obj.items() if k not in ("type", "timeout_s")}
    message_type = CHECK_TYPES[kind]
    known = {f.name for f in message_type.DESCRIPTOR.fields}
    for name, value in params.items():  # per field, so the error names the field
        if name not in known:
            raise TaskValidationError(
                f"{field}.{name}", f"unknown field for {kind}; fields: {sorted(known)}"
            )
        if value is None:  # protobuf's JSON reads null as the default ("" or 0): never meant
            raise TaskValidationError(f"{field}.{name}", f"{kind}: must not be null")
        try:
            json_format.ParseDict({name: value}, message_type(), ignore_unknown_fields=False)
        except json_format.ParseError as exc:
            raise TaskValidationError(
                f"{field}.{name}", f"{kind}: invalid value {value!r} ({exc})"
            ) from None
    for oneof in message_type.DESCRIPTOR.oneofs:  # ParseDict raises a bare ParseError for these
        given = [f.name for f in oneof.fields if f.name in params]
        if len(given) > 1:
            raise TaskValidationError(
                f"{field}.{given[1]}", f"{kind}: give one of {' or '.join(given)}, not both"
            )
    inner = json_format.ParseDict(params, message_type(), ignore_unknown_fields=False)
    check = Check(timeout_s=check_timeout_s(obj, field))
    getattr(check, kind).CopyFrom(inner)
    _validate_check(check, kind, params, field)
    return check


def check_timeout_s(obj: Mapping, field: str) -> float:
    """A check's `timeout_s` (seconds, 0 = the verifier's default). Raises TaskValidationError
    naming `<field>.timeout_s` unless it is a number in [0, 3600] (or null/absent)."""
    timeout_s = obj.get("timeout_s", 0)
    if timeout_s is None:
        timeout_s = 0
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 <= timeout_s <= 3600
    ):
        raise TaskValidationError(f"{field}.timeout_s", "must be a number of seconds in [0, 3600]")
    return float(timeout_s)


REQUIRED_CHECK_FIELDS = {
    "answer_equals": ("expected",),
    "answer_integer_equals": ("expected",),
    "answer_matches": ("pattern",),
    "file_exists": ("path",),
    "file_contains": ("path",),
    "file_sha256": ("path", "sha256"),
    "command_output_equals": ("command",),
    "command_exit_code": ("command",),
}
"""Parameters each check type needs (besides one field of each oneof: file_contains `substring` or
`regex`, command_output_equals `expected` or `reference_command`)."""


def _validate_check(check: Check, kind: str, params: Mapping, field: str) -> None:
    inner = getattr(check, kind)
    for name in REQUIRED_CHECK_FIELDS[kind]:
        if name not in params:
            raise TaskValidationError(f"{field}.{name}", f"{kind} needs '{name}'")
    if kind == "answer_matches" or (
        kind == "file_contains" and inner.WhichOneof("needle") == "regex"
    ):
        pattern = inner.pattern if kind == "answer_matches" else inner.regex
        if len(pattern) > LIMITS["pattern_chars"]:
            raise TaskValidationError(f"{field}.pattern", "regex too long")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise TaskValidationError(
                f"{field}.{'pattern' if kind == 'answer_matches' else 'regex'}",
                f"invalid regex: {exc}",
            ) from None
    if kind == "file_contains" and inner.WhichOneof("needle") is None:
        raise TaskValidationError(
            f"{field}.substring", "file_contains needs 'substring' or 'regex'"
        )
    if kind == "command_output_equals" and inner.WhichOneof("target") is None:
        raise TaskValidationError(
            f"{field}.expected", "command_output_equals needs 'expected' or 'reference_command'"
        )
    if kind == "file_sha256" and not re.fullmatch(r"[0-9a-f]{64}", inner.sha256):
        raise TaskValidationError(f"{field}.sha256", "must be 64 lowercase hex digits")
    if hasattr(inner, "path") and kind.startswith("file_"):
        if not inner.path or inner.path.startswith("/") or "\x00" in inner.path:
            raise TaskValidationError(
                f"{field}.path", "must be a non-empty path relative to the workspace"
            )


def check_to_json(check: Check) -> dict:
    kind = check.WhichOneof("kind")
    if kind == "plugin":  # a plug-in's check type: its own name and JSON fields
        import json

        out = {"type": check.plugin.type, **json.loads(check.plugin.params_json or "{}")}
        return out | ({"timeout_s": check.timeout_s} if check.timeout_s else {})
    out = {
        "type": kind,
        **json_format.MessageToDict(
            getattr(check, kind),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        ),
    }
    if kind == "answer_integer_equals":
        out["expected"] = int(out["expected"])
    if check.timeout_s:
        out["timeout_s"] = check.timeout_s
    return out


_TASK_FIELDS = {
    "task_id",
    "instruction",
    "setup",
    "env",
    "check",
    "checks",
    "split",
    "tags",
    "max_turns",
    "source",
    "reference_solution",
    "template",
    "origin",
    "independent_solution",
    "label_cross_checked",
}


def task_from_json(obj: Any, *, default_split: str = "train") -> Task:
    """A task in JSON form (the format of ../shared/tasks/*.jsonl) -> validated Task.

    Accepts `check` as one object or a list (also under `checks`). Extra provenance fields of the
    shared task files (`origin`, `independent_solution`, `label_cross_checked`) are accepted and
    dropped. Raises TaskValidationError naming the first bad field.
    """
    if not isinstance(obj, Mapping):
        raise TaskValidationError("task", "must be a JSON object")
    unknown = set(obj) - _TASK_FIELDS
    if unknown:
        raise TaskValidationError(sorted(unknown)[0], "unknown field")
    instruction = obj.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskValidationError("instruction", "must be a non-empty string")
    if first_surrogate(instruction) is not None:
        raise TaskValidationError(
            "instruction", "contains a lone UTF-16 surrogate (not valid Unicode)"
        )
    if len(instruction) > LIMITS["instruction_chars"]:
        raise TaskValidationError(
            "instruction", f"longer than {LIMITS['instruction_chars']} characters"
        )
    setup = obj.get("setup", "")
    if not isinstance(setup, str) or len(setup) > LIMITS["setup_chars"] or "\x00" in setup:
        raise TaskValidationError(
            "setup",
            f"must be a string without NUL bytes, at most {LIMITS['setup_chars']} characters",
        )
    if (at := first_surrogate(setup)) is not None:
        raise TaskValidationError(
            "setup", f"lone UTF-16 surrogate at character {at} (not valid Unicode)"
        )
    task_id = _given(obj, "task_id", "")
    if not isinstance(task_id, str) or (
        task_id and (len(task_id) > LIMITS["task_id_chars"] or not _TASK_ID.match(task_id))
    ):
        raise TaskValidationError(
            "task_id", "must match [A-Za-z0-9][A-Za-z0-9._:-]* (at most 128 characters)"
        )
    if "check" in obj and "checks" in obj:  # one would be ignored
        raise TaskValidationError("checks", "give 'check' or 'checks', not both")
    raw_checks = obj.get("checks", obj.get("check"))
    if raw_checks is None:
        raise TaskValidationError("check", "a task needs at least one check")
    raw_list = raw_checks if isinstance(raw_checks, list) else [raw_checks]
    if not raw_list or len(raw_list) > LIMITS["checks"]:
        raise TaskValidationError("check", f"1 to {LIMITS['checks']} checks")
    checks = [
        check_from_json(c, "check" if not isinstance(raw_checks, list) else f"check[{i}]")
        for i, c in enumerate(raw_list)
    ]
    env = _given(obj, "env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TaskValidationError("env", "must map strings to strings")
    for k, v in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            shown = (
                k[:200].encode("utf-8", "backslashreplace").decode()
            )  # a lone surrogate, escaped
            raise TaskValidationError(f"env.{shown}", "not a valid environment variable name")
        if "\x00" in v or first_surrogate(v) is not None:
            raise TaskValidationError(f"env.{k}", "value has a NUL byte or a lone UTF-16 surrogate")
    if env_bytes(env) > MAX_ENV_BYTES:
        raise TaskValidationError(
            "env", f"{env_bytes(env)} bytes (NAME=value plus a NUL each); at most {MAX_ENV_BYTES}"
        )
    tags = _given(obj, "tags", [])
    if (
        not isinstance(tags, list)
        or not all(isinstance(t, str) for t in tags)
        or len(tags) > LIMITS["tags"]
    ):
        raise TaskValidationError("tags", f"must be a list of at most {LIMITS['tags']} strings")
    for i, tag in enumerate(tags):
        if first_surrogate(tag) is not None:
            raise TaskValidationError(f"tags[{i}]", "contains a lone UTF-16 surrogate")
    max_turns = _given(obj, "max_turns", 0)
    if (
        isinstance(max_turns, bool)
        or not isinstance(max_turns, int)
        or not 0 <= max_turns <= LIMITS["max_turns"]
    ):
        raise TaskValidationError("max_turns", f"must be an integer in [0, {LIMITS['max_turns']}]")
    split_value = _given(obj, "split", default_split)
    if not isinstance(split_value, str):
        raise TaskValidationError("split", f"must be one of {sorted(SPLIT_NAMES)}")
    split = split_from_name(split_value)
    for name in ("source", "reference_solution", "template"):
        if not isinstance(obj.get(name, ""), str):
            raise TaskValidationError(name, "must be a string")
        if first_surrogate(obj.get(name, "")) is not None:
            raise TaskValidationError(name, "contains a lone UTF-16 surrogate")
    return Task(
        task_id=task_id,
        instruction=instruction,
        setup=setup,
        env=dict(env),
        checks=checks,
        split=split,
        tags=list(tags),
        max_turns=max_turns,
        source=obj.get("source", ""),
        reference_solution=obj.get("reference_solution", ""),
        template=obj.get("template", ""),
    )


def _given(obj: Mapping, name: str, default: Any) -> Any:
    """obj[name], or `default` when it is absent or null; a falsy value of the wrong type ({} for
    `max_turns`) stays, so that the type check refuses it."""
    value = obj.get(name)
    return default if value is None else value


def task_to_json(task: Task) -> dict:
    """Task -> JSON form (inverse of task_from_json; `check` is always a list)."""
    return {
        "task_id": task.task_id,
        "instruction": task.instruction,
        "setup": task.setup,
        "env": dict(task.env),
        "check": [check_to_json(c) for c in task.checks],
        "split": split_name(task.split),
        "tags": list(task.tags),
        "max_turns": task.max_turns,
        "source": task.source,
        "reference_solution": task.reference_solution,
        "template": task.template,
    }


def iter_tasks_jsonl(lines: Iterable[str], *, default_split: str = "train") -> Iterable[Task]:
    """Parse a JSONL task file; raises TaskValidationError with `line N: field` on the first bad line."""
    import json

    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise TaskValidationError(f"line {n}", f"invalid JSON: {exc}") from None
        try:
            yield task_from_json(obj, default_split=default_split)
        except TaskValidationError as exc:
            raise TaskValidationError(f"line {n}: {exc.field}", exc.message) from None


_GENERATED_ID = re.compile(r"^(?:eval-)?gen-(?P<template>.+)-[0-9a-f]{12}$")


def template_of(task_id: str, template: str = "", source: str = "") -> str:
    """A task's template: its `template` field, else its `source`, else parsed from a generated
    task id (`[eval-]gen-<template>-<12 hex>`), else the task id itself (a hand-written task is
    its own template). The learner groups its KL per template and the job's report its pass
    rates by this one rule."""
    if template or source:
        return template or source
    match = _GENERATED_ID.match(task_id)
    return match.group("template") if match else task_id
