"""Trajectories on the wire: per-token arrays (raw little-endian bytes: int32 token ids, float32
log-probs, uint8 loss mask; see trajectory.proto), segments, typed array views and parsing.
Decoders validate byte lengths and raise ValueError (ContractError for a whole trajectory)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from shellrl.contract.errors import ContractError
from shellrl.v1.trajectory_pb2 import (
    FinishReason,
    SamplingParams,
    Segment,
    SegmentKind,
    ToolEvent,
    Trajectory,
)

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")

ACTION = SegmentKind.SEGMENT_KIND_ACTION
OBSERVATION = SegmentKind.SEGMENT_KIND_OBSERVATION


# --- per-token arrays ---------------------------------------------------------------------


def encode_token_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """ids: [N] ints in int32 range -> 4N bytes little-endian. Raises ValueError for a value out of
    range or not an integer (numpy would wrap an int64 array silently).

    Lists (the engine's JSON output) go through `struct`, about 2x faster than numpy for them
    (benchmarks/bench_streams.py); arrays through numpy. Both give the same bytes."""
    if isinstance(ids, np.ndarray):
        if (
            ids.dtype != I32
            and ids.size
            and (ids.min() < np.iinfo(I32).min or ids.max() > np.iinfo(I32).max)
        ):
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


def observation_segment(
    token_ids: Sequence[int], *, tool_event: ToolEvent | None = None, turn: int = 0
) -> Segment:
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
        raise ContractError(
            f"prompt_ids: {len(traj.prompt_ids)} bytes is not a multiple of 4 (int32)"
        )
    lengths = []
    for i, seg in enumerate(traj.segments):
        n_ids, n_lps, n_mask = len(seg.token_ids), len(seg.logprobs), len(seg.loss_mask)
        if n_ids % 4 or n_lps % 4 or not (n_ids // 4 == n_lps // 4 == n_mask):
            raise ContractError(
                f"segments[{i}]: {n_ids / 4:g} token ids, {n_lps / 4:g} logprobs, "
                f"{n_mask} mask entries (bytes: int32, float32, uint8)"
            )
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
    versions = np.array(
        [s.policy_version if s.kind == ACTION else -1 for s in segs], dtype=np.int64
    )
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


CHECK_DETAIL_CHARS = 1_000  # of one check's detail kept in a trajectory (Trajectory.checks)


def set_check_results(traj: Trajectory, checks: Sequence[dict]) -> None:
    """Replace `traj.checks` (the verifier's per-check results, task order) with `checks`, each
    in the JSON form of the verifier's `POST /v1/verify` (type, passed, detail, duration_ms);
    a detail is cut to CHECK_DETAIL_CHARS characters."""
    del traj.checks[:]
    for c in checks:
        traj.checks.add(
            type=str(c.get("type", "")),
            passed=bool(c.get("passed")),
            detail=str(c.get("detail") or "")[:CHECK_DETAIL_CHARS],
            duration_ms=float(c.get("duration_ms") or 0.0),
        )


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
