"""Trajectory wire form: lossless protobuf round trip, validation of per-token arrays."""

from __future__ import annotations

import numpy as np
import pytest

from shellrl import contract
from shellrl.contract import (
    ContractError,
    SamplingParams,
    ToolEvent,
    Trajectory,
    action_segment,
    observation_segment,
    parse_trajectory,
    trajectory_arrays,
)

PROMPT_TOKENS = 596
SEGMENT_TOKENS = (1200, 300, 1000, 400, 600)  # ACTION, OBSERVATION, ACTION, OBSERVATION, ACTION


def _special_logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 log-probs including values a float64 detour or a text format would change."""
    lps = -rng.exponential(2.0, n).astype(np.float32)
    specials = np.array(
        [
            -0.0,
            0.0,
            -1e-45,
            -np.float32(1.17549435e-38),
            -3.4028235e38,
            -np.inf,
            np.nextafter(np.float32(-1), np.float32(0)),
        ],
        dtype=np.float32,
    )
    lps[: len(specials)] = specials
    return lps


def make_trajectory(seed: int = 0) -> tuple[Trajectory, dict]:
    """A 4,096-token trajectory: 596 prompt tokens, then 3 ACTION and 2 OBSERVATION segments."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 49_152, PROMPT_TOKENS).astype(np.int32)
    expected = {"prompt": prompt, "ids": [], "lps": [], "masks": [], "versions": []}
    segments = []
    for i, n in enumerate(SEGMENT_TOKENS):
        ids = rng.integers(0, 49_152, n).astype(np.int32)
        if i % 2 == 0:
            lps = _special_logprobs(rng, n)
            seg = action_segment(
                ids,
                lps,
                policy_version=7 + i,
                request_id=f"rid-{i}",
                turn=i // 2,
                sampling=SamplingParams(temperature=1.0, top_p=0.95, top_k=-1, max_new_tokens=n),
            )
            expected["lps"].append(lps)
            expected["masks"].append(np.ones(n, np.uint8))
            expected["versions"].append(np.full(n, 7 + i))
        else:
            tool = ToolEvent(
                command="ls -la | wc -l",
                exit_code=0,
                duration_ms=12.5,
                stdout_truncated_bytes=1 << 40,
                policy_verdict="allow",
            )
            seg = observation_segment(ids, tool_event=tool, turn=i // 2)
            expected["lps"].append(np.zeros(n, np.float32))
            expected["masks"].append(np.zeros(n, np.uint8))
            expected["versions"].append(np.full(n, -1))
        expected["ids"].append(ids)
        segments.append(seg)
    traj = Trajectory(
        trajectory_id="traj-0001",
        task_id="agentbench-os-train-0012",
        group_id="group-7",
        attempt=1,
        prompt_ids=contract.encode_token_ids(prompt),
        segments=segments,
        reward=0.75,
        reward_components={"task": 1.0, "shaping": -0.25},
        terminated=True,
        failure=contract.Failure.FAILURE_NONE,
        sandbox_session_id="sess-1",
        created_at=1_790_000_000.123456,
        group_size=8,
        safety_events=["rm_rf_root"],
    )
    return traj, expected


def test_trajectory_of_4096_tokens_with_3_actions_and_2_observations_round_trips_losslessly():
    traj, expected = make_trajectory()
    assert PROMPT_TOKENS + sum(SEGMENT_TOKENS) == 4096
    kinds = [s.kind for s in traj.segments]
    assert kinds.count(contract.ACTION) == 3 and kinds.count(contract.OBSERVATION) == 2

    raw = traj.SerializeToString()
    back = parse_trajectory(raw)

    assert back == traj
    # byte-equal only in deterministic mode: protobuf does not fix the order of map entries
    # (reward_components), and upb's order differs between instances now and then
    assert back.SerializeToString(deterministic=True) == traj.SerializeToString(deterministic=True)
    arrays = trajectory_arrays(back)
    np.testing.assert_array_equal(arrays.prompt_ids, expected["prompt"])
    np.testing.assert_array_equal(arrays.response_ids, np.concatenate(expected["ids"]))
    np.testing.assert_array_equal(arrays.loss_mask, np.concatenate(expected["masks"]))
    np.testing.assert_array_equal(arrays.policy_versions, np.concatenate(expected["versions"]))
    assert arrays.input_ids.shape == (4096,)
    assert arrays.behavior_logprobs.dtype == np.float32
    # bit-exact: compare the IEEE 754 bit patterns (distinguishes -0.0 from 0.0, keeps subnormals)
    np.testing.assert_array_equal(
        arrays.behavior_logprobs.view(np.uint32), np.concatenate(expected["lps"]).view(np.uint32)
    )
    assert back.segments[1].tool_event.stdout_truncated_bytes == 1 << 40
    assert back.created_at == 1_790_000_000.123456
    assert dict(back.reward_components) == {"task": 1.0, "shaping": -0.25}


def test_nan_logprob_payload_survives_bit_exact():
    bits = np.array([0x7FC00001, 0xFFC12345], dtype=np.uint32)
    seg = action_segment([1, 2], bits.view(np.float32), policy_version=0)
    back = Trajectory.FromString(Trajectory(trajectory_id="t", segments=[seg]).SerializeToString())
    np.testing.assert_array_equal(
        contract.decode_logprobs(back.segments[0].logprobs).view(np.uint32), bits
    )


def test_min_policy_version_is_the_oldest_action_version():
    traj, _ = make_trajectory()
    assert contract.min_policy_version(traj) == 7
    assert contract.min_policy_version(Trajectory(trajectory_id="t")) is None


def test_bad_protobuf_bytes_raise_contract_error():
    with pytest.raises(ContractError, match="not a shellrl.v1.Trajectory"):
        parse_trajectory(b"\xff\xff\xff\xff not protobuf")


def test_trajectory_without_id_is_rejected():
    with pytest.raises(ContractError, match="trajectory_id"):
        parse_trajectory(Trajectory(task_id="t").SerializeToString())


def test_segment_arrays_of_different_lengths_are_rejected():
    seg = action_segment([1, 2, 3], [-0.1, -0.2, -0.3], policy_version=1)
    seg.logprobs = seg.logprobs[:8]
    with pytest.raises(
        ContractError, match=r"segments\[0\]: 3 token ids, 2 logprobs, 3 mask entries"
    ):
        parse_trajectory(Trajectory(trajectory_id="t", segments=[seg]).SerializeToString())


def test_array_byte_length_not_a_multiple_of_4_is_rejected():
    with pytest.raises(ContractError, match="multiple of 4"):
        contract.decode_token_ids(b"\x01\x02\x03")
    with pytest.raises(ContractError, match="multiple of 4"):
        contract.decode_logprobs(b"\x01\x02\x03\x04\x05")


def test_loss_mask_must_match_segment_kind_and_be_binary():
    seg = action_segment([1, 2], [-0.5, -0.5], policy_version=1)
    seg.loss_mask = b"\x01\x00"
    with pytest.raises(ContractError, match="ACTION segment with loss mask 0"):
        trajectory_arrays(Trajectory(trajectory_id="t", segments=[seg]))
    seg.loss_mask = b"\x01\x02"
    with pytest.raises(ContractError, match="0 or 1"):
        trajectory_arrays(Trajectory(trajectory_id="t", segments=[seg]))
    obs = observation_segment([5, 6])
    obs.loss_mask = b"\x00\x01"
    with pytest.raises(ContractError, match="OBSERVATION segment with loss mask 1"):
        trajectory_arrays(Trajectory(trajectory_id="t", segments=[obs]))


def test_action_segment_needs_one_logprob_per_token():
    with pytest.raises(ValueError, match="3 token ids but 2 logprobs"):
        action_segment([1, 2, 3], [-1.0, -1.0], policy_version=0)


def test_token_ids_outside_int32_are_rejected_instead_of_wrapping():
    with pytest.raises(ValueError, match="int32"):
        contract.encode_token_ids(np.array([2**31], dtype=np.int64))
    with pytest.raises(ValueError, match="token_ids"):
        contract.encode_token_ids([2**40])


def test_arrays_are_little_endian_on_the_wire():
    assert contract.encode_token_ids([1]) == b"\x01\x00\x00\x00"
    assert contract.encode_logprobs([-1.0]) == b"\x00\x00\x80\xbf"


def test_failure_label_is_the_lower_case_class_without_its_prefix_for_every_failure():
    labels = {name: contract.failure_label(value) for name, value in contract.Failure.items()}
    assert labels["FAILURE_NONE"] == "none"
    assert labels["FAILURE_INFRA_ENGINE"] == "infra_engine"
    assert labels["FAILURE_INFRA_VERIFIER"] == "infra_verifier"
    assert all(label == label.lower() and "failure" not in label for label in labels.values())
    assert len(set(labels.values())) == len(labels)
