"""Typed Python views of the protobuf data contract (proto/shellrl/v1). The only module that
touches the generated `*_pb2` code; services import messages and helpers from here.

Glossary (one word per concept, DESIGN.md section 4):
  task            a shell problem: instruction, setup script, typed checks, split.
  trajectory      one episode of one task: prompt_ids, then segments; scored by the verifier.
  segment         one model call (ACTION: engine-sampled tokens, loss mask 1, behavior log-probs,
                  policy_version) or the harness text after it (OBSERVATION: loss mask 0).
  group           the G trajectories of one task sampled together for GRPO (`group_id`).
  policy_version  number of optimizer steps the weights have taken (engine `weight_version`).
  staleness       learner_version - min(policy_version of a trajectory's ACTION segments).
  behavior_logprobs  log-probs the engine sampled with; proximal_logprobs: the learner's at
                  the start of a step; logprobs: the learner's current ones.

Wire form of per-token arrays: raw little-endian bytes (int32 token ids, float32 log-probs,
uint8 loss mask), see trajectory.proto. Decoders validate byte lengths and raise ValueError.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError

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
from shellrl.v1.trajectory_pb2 import (
    EpisodeEnd,
    Failure,
    FinishReason,
    SamplingParams,
    Segment,
    SegmentKind,
    ToolEvent,
    Trajectory,
)

__all__ = [
    "AnswerEquals", "AnswerIntegerEquals", "AnswerMatches", "Check", "CommandExitCode",
    "CommandOutputEquals", "FileContains", "FileExists", "FileSha256", "Split", "Task",
    "EpisodeEnd", "Failure", "FinishReason", "SamplingParams", "Segment", "SegmentKind",
    "ToolEvent", "Trajectory", "ContractError", "TaskValidationError",
    "encode_token_ids", "decode_token_ids", "encode_logprobs", "decode_logprobs",
    "encode_loss_mask", "decode_loss_mask", "action_segment", "observation_segment",
    "TrajectoryArrays", "trajectory_arrays", "min_policy_version", "parse_trajectory",
    "task_from_json", "task_to_json", "check_from_json", "check_to_json", "iter_tasks_jsonl", "CHECK_TYPES",
    "split_name", "split_from_name",
]

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")

ACTION = SegmentKind.SEGMENT_KIND_ACTION
OBSERVATION = SegmentKind.SEGMENT_KIND_OBSERVATION


class ContractError(ValueError):
    """Bytes or a message that violate the data contract (bad protobuf, bad array lengths)."""


class TaskValidationError(ValueError):
    """A task (JSON form) that fails validation; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


# --- per-token arrays ---------------------------------------------------------------------

def encode_token_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """ids: [N] ints in int32 range -> 4N bytes little-endian. Raises ValueError for a value out of
    range or not an integer (numpy would wrap an int64 array silently).

    Lists (the engine's JSON output) go through `struct`, about 2x faster than numpy for them
    (benchmarks/bench_streams.py); arrays through numpy. Both give the same bytes."""
    if isinstance(ids, np.ndarray):
        if ids.dtype != I32 and ids.size and (ids.min() < np.iinfo(I32).min or ids.max() > np.iinfo(I32).max):
            raise ValueError("token_ids: value outside the int32 range")
        return np.asarray(ids, dtype=I32).tobytes()
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise ValueError(f"token_ids: {exc}") from None


def decode_token_ids(raw: bytes) -> np.ndarray:
    """4N bytes -> [N] int32 (read-only view). Raises ContractError on a length not divisible by 4."""
    if len(raw) % 4:
        raise ContractError(f"token_ids: {len(raw)} bytes is not a multiple of 4 (int32)")
    return np.frombuffer(raw, dtype=I32)


def encode_logprobs(logprobs: Sequence[float] | np.ndarray) -> bytes:
    """logprobs: [N] floats -> 4N bytes float32 little-endian (IEEE 754 round to nearest, as numpy)."""
    if not isinstance(logprobs, np.ndarray):
        try:
            return struct.pack(f"<{len(logprobs)}f", *logprobs)
        except (OverflowError, struct.error):  # beyond float32 range: numpy rounds to +-inf
            pass
    return np.asarray(logprobs, dtype=F32).tobytes()


def decode_logprobs(raw: bytes) -> np.ndarray:
    """4N bytes -> [N] float32 (read-only view). Raises ContractError on a bad length."""
    if len(raw) % 4:
        raise ContractError(f"logprobs: {len(raw)} bytes is not a multiple of 4 (float32)")
    return np.frombuffer(raw, dtype=F32)


def encode_loss_mask(mask: Sequence[int] | np.ndarray) -> bytes:
    """mask: [N] of 0/1 -> N bytes uint8."""
    return np.asarray(mask, dtype=U8).tobytes()


def decode_loss_mask(raw: bytes) -> np.ndarray:
    """N bytes -> [N] uint8 (read-only view); values other than 0/1 are rejected by trajectory_arrays."""
    return np.frombuffer(raw, dtype=U8)


def action_segment(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    policy_version: int,
    *,
    finish_reason: int = FinishReason.FINISH_REASON_STOP,
    request_id: str = "",
    sampling: SamplingParams | None = None,
    turn: int = 0,
) -> Segment:
    """An ACTION segment: engine-sampled tokens with their behavior log-probs, loss mask 1.

    Raises ValueError when token_ids and logprobs differ in length.
    """
    if len(token_ids) != len(logprobs):
        raise ValueError(f"action_segment: {len(token_ids)} token ids but {len(logprobs)} logprobs")
    n = len(token_ids)
    return Segment(
        kind=ACTION,
        policy_version=policy_version,
        token_ids=encode_token_ids(token_ids),
        logprobs=encode_logprobs(logprobs),
        loss_mask=b"\x01" * n,
        finish_reason=finish_reason,
        request_id=request_id,
        sampling=sampling,
        turn=turn,
    )


def observation_segment(token_ids: Sequence[int], *, tool_event: ToolEvent | None = None, turn: int = 0) -> Segment:
    """An OBSERVATION segment: harness tokens (tool output, template tokens), loss mask 0."""
    n = len(token_ids)
    return Segment(
        kind=OBSERVATION,
        policy_version=-1,
        token_ids=encode_token_ids(token_ids),
        logprobs=b"\x00" * (4 * n),
        loss_mask=b"\x00" * n,
        tool_event=tool_event,
        turn=turn,
    )


@dataclass(frozen=True)
class TrajectoryArrays:
    """Flat arrays of one trajectory.

    prompt_ids: [P] int32. response_ids, behavior_logprobs, loss_mask, policy_versions: [R]
    (int32, float32, uint8, int64). policy_versions is -1 on OBSERVATION tokens.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behavior_logprobs: np.ndarray
    loss_mask: np.ndarray
    policy_versions: np.ndarray

    @property
    def input_ids(self) -> np.ndarray:
        """[P+R] int32: the whole token sequence."""
        return np.concatenate([self.prompt_ids, self.response_ids])


def _check_segments(traj: Trajectory) -> list[int]:
    """Validate every segment on the raw bytes (no arrays built); returns token counts per segment.

    Raises ContractError naming the first bad segment."""
    if len(traj.prompt_ids) % 4:
        raise ContractError(f"prompt_ids: {len(traj.prompt_ids)} bytes is not a multiple of 4 (int32)")
    lengths = []
    for i, seg in enumerate(traj.segments):
        n_ids, n_lps, n_mask = len(seg.token_ids), len(seg.logprobs), len(seg.loss_mask)
        if n_ids % 4 or n_lps % 4 or not (n_ids // 4 == n_lps // 4 == n_mask):
            raise ContractError(f"segments[{i}]: {n_ids / 4:g} token ids, {n_lps / 4:g} logprobs, "
                                f"{n_mask} mask entries (bytes: int32, float32, uint8)")
        if seg.kind not in (ACTION, OBSERVATION):
            raise ContractError(f"segments[{i}]: kind must be ACTION or OBSERVATION")
        want = 1 if seg.kind == ACTION else 0
        if seg.loss_mask.count(want) != n_mask:  # a C loop over the bytes
            if seg.loss_mask.translate(None, b"\x00\x01"):
                raise ContractError(f"segments[{i}]: loss mask values must be 0 or 1")
            kind = "ACTION" if want else "OBSERVATION"
            raise ContractError(f"segments[{i}]: {kind} segment with loss mask {1 - want}")
        lengths.append(n_mask)
    return lengths


def trajectory_arrays(traj: Trajectory) -> TrajectoryArrays:
    """Decode and validate a trajectory's per-token arrays (one copy per array, no per-token Python).

    Raises ContractError when a segment's arrays disagree in length, an ACTION token has mask 0,
    an OBSERVATION token has mask 1, or a mask value is not 0/1.
    """
    lengths = _check_segments(traj)
    segs = traj.segments
    versions = np.array([s.policy_version if s.kind == ACTION else -1 for s in segs], dtype=np.int64)
    return TrajectoryArrays(
        prompt_ids=np.frombuffer(traj.prompt_ids, dtype=I32),
        response_ids=np.frombuffer(b"".join(s.token_ids for s in segs), dtype=I32),
        behavior_logprobs=np.frombuffer(b"".join(s.logprobs for s in segs), dtype=F32),
        loss_mask=np.frombuffer(b"".join(s.loss_mask for s in segs), dtype=U8),
        policy_versions=np.repeat(versions, lengths),
    )


def min_policy_version(traj: Trajectory) -> int | None:
    """The oldest weight version that produced a token of the trajectory (None: no ACTION)."""
    versions = [s.policy_version for s in traj.segments if s.kind == ACTION and len(s.token_ids)]
    return min(versions) if versions else None


def parse_trajectory(raw: bytes) -> Trajectory:
    """Bytes from a stream entry -> Trajectory, with its arrays validated. Raises ContractError."""
    traj = Trajectory()
    try:
        traj.ParseFromString(raw)
    except DecodeError as exc:
        raise ContractError(f"not a shellrl.v1.Trajectory: {exc}") from exc
    if not traj.trajectory_id:
        raise ContractError("trajectory_id is empty")
    _check_segments(traj)
    return traj


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

SPLIT_NAMES = {"train": Split.SPLIT_TRAIN, "eval_id": Split.SPLIT_EVAL_ID, "eval_ood": Split.SPLIT_EVAL_OOD,
               "eval": Split.SPLIT_EVAL}
_SPLIT_BY_VALUE = {v: k for k, v in SPLIT_NAMES.items()}

LIMITS = {"instruction_chars": 16_384, "setup_chars": 65_536, "checks": 16, "tags": 32, "max_turns": 64,
          "task_id_chars": 128, "pattern_chars": 4096}
_TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


def split_name(split: int) -> str:
    return _SPLIT_BY_VALUE.get(split, "unspecified")


def split_from_name(name: str) -> int:
    try:
        return SPLIT_NAMES[name]
    except KeyError:
        raise TaskValidationError("split", f"unknown split {name!r}; one of {sorted(SPLIT_NAMES)}") from None


def check_from_json(obj: Any, field: str = "check") -> Check:
    """`{"type": "answer_integer_equals", "expected": 4, "timeout_s"?: 5}` -> Check."""
    if not isinstance(obj, Mapping):
        raise TaskValidationError(field, "must be an object with a 'type'")
    kind = obj.get("type")
    if kind not in CHECK_TYPES:
        raise TaskValidationError(f"{field}.type", f"unknown check type {kind!r}; one of {sorted(CHECK_TYPES)}")
    params = {k: v for k, v in obj.items() if k not in ("type", "timeout_s")}
    message_type = CHECK_TYPES[kind]
    known = {f.name for f in message_type.DESCRIPTOR.fields}
    for name, value in params.items():  # per field, so the error names the field
        if name not in known:
            raise TaskValidationError(f"{field}.{name}", f"unknown field for {kind}; fields: {sorted(known)}")
        try:
            json_format.ParseDict({name: value}, message_type(), ignore_unknown_fields=False)
        except json_format.ParseError as exc:
            raise TaskValidationError(f"{field}.{name}", f"{kind}: invalid value {value!r} ({exc})") from None
    inner = json_format.ParseDict(params, message_type(), ignore_unknown_fields=False)
    timeout_s = obj.get("timeout_s", 0)
    if timeout_s is None:
        timeout_s = 0
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s <= 3600:
        raise TaskValidationError(f"{field}.timeout_s", "must be a number of seconds in [0, 3600]")
    check = Check(timeout_s=float(timeout_s))
    getattr(check, kind).CopyFrom(inner)
    _validate_check(check, kind, params, field)
    return check


def _validate_check(check: Check, kind: str, params: Mapping, field: str) -> None:
    inner = getattr(check, kind)
    required = {
        "answer_equals": ("expected",), "answer_integer_equals": ("expected",), "answer_matches": ("pattern",),
        "file_exists": ("path",), "file_contains": ("path",), "file_sha256": ("path", "sha256"),
        "command_output_equals": ("command",), "command_exit_code": ("command",),
    }[kind]
    for name in required:
        if name not in params:
            raise TaskValidationError(f"{field}.{name}", f"{kind} needs '{name}'")
    if kind == "answer_matches" or (kind == "file_contains" and inner.WhichOneof("needle") == "regex"):
        pattern = inner.pattern if kind == "answer_matches" else inner.regex
        if len(pattern) > LIMITS["pattern_chars"]:
            raise TaskValidationError(f"{field}.pattern", "regex too long")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise TaskValidationError(f"{field}.{'pattern' if kind == 'answer_matches' else 'regex'}",
                                      f"invalid regex: {exc}") from None
    if kind == "file_contains" and inner.WhichOneof("needle") is None:
        raise TaskValidationError(f"{field}.substring", "file_contains needs 'substring' or 'regex'")
    if kind == "command_output_equals" and inner.WhichOneof("target") is None:
        raise TaskValidationError(f"{field}.expected", "command_output_equals needs 'expected' or 'reference_command'")
    if kind == "file_sha256" and not re.fullmatch(r"[0-9a-f]{64}", inner.sha256):
        raise TaskValidationError(f"{field}.sha256", "must be 64 lowercase hex digits")
    if hasattr(inner, "path") and kind.startswith("file_"):
        if not inner.path or inner.path.startswith("/") or "\x00" in inner.path:
            raise TaskValidationError(f"{field}.path", "must be a non-empty path relative to the workspace")


def check_to_json(check: Check) -> dict:
    kind = check.WhichOneof("kind")
    out = {"type": kind, **json_format.MessageToDict(getattr(check, kind), preserving_proto_field_name=True,
                                                      always_print_fields_with_no_presence=True)}
    if kind == "answer_integer_equals":
        out["expected"] = int(out["expected"])
    if check.timeout_s:
        out["timeout_s"] = check.timeout_s
    return out


_TASK_FIELDS = {"task_id", "instruction", "setup", "env", "check", "checks", "split", "tags", "max_turns", "source",
                "reference_solution", "template", "origin", "independent_solution", "label_cross_checked"}


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
    if len(instruction) > LIMITS["instruction_chars"]:
        raise TaskValidationError("instruction", f"longer than {LIMITS['instruction_chars']} characters")
    setup = obj.get("setup", "")
    if not isinstance(setup, str) or len(setup) > LIMITS["setup_chars"] or "\x00" in setup:
        raise TaskValidationError("setup", f"must be a string without NUL bytes, at most {LIMITS['setup_chars']} characters")
    task_id = obj.get("task_id", "")
    if task_id and (not isinstance(task_id, str) or len(task_id) > LIMITS["task_id_chars"] or not _TASK_ID.match(task_id)):
        raise TaskValidationError("task_id", "must match [A-Za-z0-9][A-Za-z0-9._:-]* (at most 128 characters)")
    raw_checks = obj.get("checks", obj.get("check"))
    if raw_checks is None:
        raise TaskValidationError("check", "a task needs at least one check")
    raw_list = raw_checks if isinstance(raw_checks, list) else [raw_checks]
    if not raw_list or len(raw_list) > LIMITS["checks"]:
        raise TaskValidationError("check", f"1 to {LIMITS['checks']} checks")
    checks = [check_from_json(c, "check" if not isinstance(raw_checks, list) else f"check[{i}]")
              for i, c in enumerate(raw_list)]
    env = obj.get("env", {}) or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TaskValidationError("env", "must map strings to strings")
    for k in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise TaskValidationError(f"env.{k}", "not a valid environment variable name")
    tags = obj.get("tags", []) or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags) or len(tags) > LIMITS["tags"]:
        raise TaskValidationError("tags", f"must be a list of at most {LIMITS['tags']} strings")
    max_turns = obj.get("max_turns", 0) or 0
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not 0 <= max_turns <= LIMITS["max_turns"]:
        raise TaskValidationError("max_turns", f"must be an integer in [0, {LIMITS['max_turns']}]")
    split_value = obj.get("split") or default_split
    if not isinstance(split_value, str):
        raise TaskValidationError("split", f"must be one of {sorted(SPLIT_NAMES)}")
    split = split_from_name(split_value)
    for name in ("source", "reference_solution", "template"):
        if not isinstance(obj.get(name, ""), str):
            raise TaskValidationError(name, "must be a string")
    return Task(
        task_id=task_id, instruction=instruction, setup=setup, env=dict(env), checks=checks, split=split,
        tags=list(tags), max_turns=max_turns, source=obj.get("source", ""),
        reference_solution=obj.get("reference_solution", ""), template=obj.get("template", ""),
    )


def task_to_json(task: Task) -> dict:
    """Task -> JSON form (inverse of task_from_json; `check` is always a list)."""
    return {
        "task_id": task.task_id, "instruction": task.instruction, "setup": task.setup, "env": dict(task.env),
        "check": [check_to_json(c) for c in task.checks], "split": split_name(task.split), "tags": list(task.tags),
        "max_turns": task.max_turns, "source": task.source, "reference_solution": task.reference_solution,
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
