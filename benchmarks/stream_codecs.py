"""The content and wire forms of benchmarks/bench_streams.py: 4,096-token trajectories as plain
Python values (`make_contents`) and their encoders and decoders (`CODECS`: protobuf with raw LE
bytes, the contract; protobuf with packed repeated arrays, built from a descriptor at run time;
JSON with orjson lists). Each decoder returns the flat arrays the learner needs; `codec_micro`
times them in one process.
"""

from __future__ import annotations

import timeit

import numpy as np
import orjson

from shellrl import contract
from shellrl.contract import SamplingParams, ToolEvent, Trajectory

PROMPT_TOKENS = 596
SEGMENT_TOKENS = (1200, 300, 1000, 400, 600)  # ACTION, OBSERVATION, ACTION, OBSERVATION, ACTION


# --- the content: a trajectory as plain Python values ------------------------------------


def make_contents(k: int = 8, seed: int = 0) -> list[dict]:
    """k different 4,096-token trajectories as dicts of Python lists (JSON-ready)."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(k):
        segments = []
        for i, n in enumerate(SEGMENT_TOKENS):
            action = i % 2 == 0
            segments.append(
                {
                    "kind": 1 if action else 2,
                    "policy_version": 40 + j if action else -1,
                    "token_ids": rng.integers(0, 49_152, n).tolist(),
                    "logprobs": (-rng.exponential(2.0, n)).astype(np.float32).tolist()
                    if action
                    else [0.0] * n,
                    "loss_mask": [1 if action else 0] * n,
                    "finish_reason": 1 if action else 0,
                    "request_id": f"req-{j}-{i}" if action else "",
                    "turn": i // 2,
                    "command": "" if action else "find . -name '*.log' | wc -l",
                    "exit_code": 0,
                }
            )
        out.append(
            {
                "task_id": f"agentbench-os-train-{j:04d}",
                "group_id": f"group-{j}",
                "attempt": 0,
                "prompt_ids": rng.integers(0, 49_152, PROMPT_TOKENS).tolist(),
                "segments": segments,
                "reward": 1.0,
                "terminated": True,
            }
        )
    return out


# --- encoders / decoders --------------------------------------------------------------------


def encode_pb_bytes(c: dict, trajectory_id: str) -> bytes:
    segments = []
    for s in c["segments"]:
        if s["kind"] == 1:
            segments.append(
                contract.action_segment(
                    s["token_ids"],
                    s["logprobs"],
                    s["policy_version"],
                    finish_reason=s["finish_reason"],
                    request_id=s["request_id"],
                    turn=s["turn"],
                    sampling=SamplingParams(temperature=1.0, top_p=1.0),
                )
            )
        else:
            segments.append(
                contract.observation_segment(
                    s["token_ids"],
                    tool_event=ToolEvent(command=s["command"], exit_code=s["exit_code"]),
                    turn=s["turn"],
                )
            )
    return Trajectory(
        trajectory_id=trajectory_id,
        task_id=c["task_id"],
        group_id=c["group_id"],
        attempt=c["attempt"],
        prompt_ids=contract.encode_token_ids(c["prompt_ids"]),
        segments=segments,
        reward=c["reward"],
        terminated=c["terminated"],
    ).SerializeToString()


def decode_pb_bytes(raw: bytes) -> tuple:
    a = contract.trajectory_arrays(contract.parse_trajectory(raw))
    return a.prompt_ids, a.response_ids, a.behavior_logprobs, a.loss_mask


_PACKED_CLASS = None


def packed_trajectory_class():
    """The contract's Trajectory/Segment with packed repeated per-token arrays (benchmark only)."""
    global _PACKED_CLASS
    if _PACKED_CLASS is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        F = descriptor_pb2.FieldDescriptorProto
        opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
        fdp = descriptor_pb2.FileDescriptorProto(
            name="shellrl_bench_packed.proto", package="shellrl.bench", syntax="proto3"
        )
        seg = fdp.message_type.add(name="PackedSegment")
        for number, name, label, kind in [
            (1, "kind", opt, F.TYPE_INT32),
            (2, "policy_version", opt, F.TYPE_INT64),
            (3, "token_ids", rep, F.TYPE_INT32),
            (4, "logprobs", rep, F.TYPE_FLOAT),
            (5, "loss_mask", rep, F.TYPE_BOOL),
            (6, "finish_reason", opt, F.TYPE_INT32),
            (7, "request_id", opt, F.TYPE_STRING),
            (10, "turn", opt, F.TYPE_UINT32),
            (11, "command", opt, F.TYPE_STRING),
            (12, "exit_code", opt, F.TYPE_INT32),
        ]:
            seg.field.add(name=name, number=number, label=label, type=kind)
        traj = fdp.message_type.add(name="PackedTrajectory")
        for number, name, label, kind in [
            (1, "trajectory_id", opt, F.TYPE_STRING),
            (2, "task_id", opt, F.TYPE_STRING),
            (3, "group_id", opt, F.TYPE_STRING),
            (4, "attempt", opt, F.TYPE_UINT32),
            (8, "prompt_ids", rep, F.TYPE_INT32),
            (10, "reward", opt, F.TYPE_DOUBLE),
            (12, "terminated", opt, F.TYPE_BOOL),
        ]:
            traj.field.add(name=name, number=number, label=label, type=kind)
        traj.field.add(
            name="segments",
            number=9,
            label=rep,
            type=F.TYPE_MESSAGE,
            type_name=".shellrl.bench.PackedSegment",
        )
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        _PACKED_CLASS = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("shellrl.bench.PackedTrajectory")
        )
    return _PACKED_CLASS


def encode_pb_packed(c: dict, trajectory_id: str) -> bytes:
    cls = packed_trajectory_class()
    return cls(
        trajectory_id=trajectory_id,
        task_id=c["task_id"],
        group_id=c["group_id"],
        attempt=c["attempt"],
        prompt_ids=c["prompt_ids"],
        segments=c["segments"],
        reward=c["reward"],
        terminated=c["terminated"],
    ).SerializeToString()


def _flat(prompt, segments, get) -> tuple:
    ids, lps, masks = [], [], []
    for s in segments:
        t, lp, m = (
            np.array(get(s, "token_ids"), np.int32),
            np.array(get(s, "logprobs"), np.float32),
            np.array(get(s, "loss_mask"), np.uint8),
        )
        if not (len(t) == len(lp) == len(m)):
            raise ValueError("segment arrays disagree in length")
        ids.append(t)
        lps.append(lp)
        masks.append(m)
    return (
        np.array(prompt, np.int32),
        np.concatenate(ids),
        np.concatenate(lps),
        np.concatenate(masks),
    )


def decode_pb_packed(raw: bytes) -> tuple:
    msg = packed_trajectory_class().FromString(raw)
    return _flat(msg.prompt_ids, msg.segments, getattr)


def encode_json(c: dict, trajectory_id: str) -> bytes:
    return orjson.dumps({"trajectory_id": trajectory_id, **c})


def decode_json(raw: bytes) -> tuple:
    obj = orjson.loads(raw)
    return _flat(obj["prompt_ids"], obj["segments"], dict.__getitem__)


CODECS = {
    "pb-bytes": (encode_pb_bytes, decode_pb_bytes),
    "pb-packed": (encode_pb_packed, decode_pb_packed),
    "json": (encode_json, decode_json),
}


def codec_micro(number: int = 50, repeat: int = 5) -> dict[str, dict[str, float]]:
    """Encode / decode time per trajectory in this process (best of `repeat`), µs."""
    c = make_contents(1)[0]
    out = {}
    for fmt, (enc, dec) in CODECS.items():
        raw = enc(c, "micro")
        got = dec(raw)
        want = decode_pb_bytes(encode_pb_bytes(c, "micro"))
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), f"{fmt} is not lossless"
        e = (
            min(timeit.repeat(lambda enc=enc: enc(c, "micro"), number=number, repeat=repeat))
            / number
            * 1e6
        )
        d = (
            min(timeit.repeat(lambda dec=dec, raw=raw: dec(raw), number=number, repeat=repeat))
            / number
            * 1e6
        )
        out[fmt] = {"encode_us": e, "decode_us": d, "bytes": len(raw)}
    return out
