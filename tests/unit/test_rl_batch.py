import numpy as np
import pytest
import torch

from shellrl.rl.batch import TrainSample, build_batch


def sample(tid, prompt, response, mask=None, advantage=1.0, temperature=1.0, version=0):
    r = len(response)
    mask = np.ones(r, dtype=np.uint8) if mask is None else np.asarray(mask, dtype=np.uint8)
    return TrainSample(
        trajectory_id=tid,
        prompt_ids=np.asarray(prompt),
        response_ids=np.asarray(response),
        behavior_logprobs=np.where(mask > 0, -0.1 * (np.arange(r) + 1), 0.0).astype(np.float32),
        loss_mask=mask,
        policy_versions=np.where(mask > 0, version, -1).astype(np.int64),
        temperatures=np.full(r, temperature, dtype=np.float32),
        advantage=advantage,
    )


def test_shift_by_one_puts_a_p3_r4_response_at_columns_2_to_5():
    batch = build_batch(
        [sample("a", [10, 11, 12], [20, 21, 22, 23]), sample("b", [10] * 6, [30, 31, 32])],
        pad_token_id=0,
    )
    assert batch.input_ids.shape == (2, 9) and batch.loss_mask.shape == (2, 8)
    row = 0
    assert batch.loss_mask[row].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    np.testing.assert_allclose(
        batch.behavior_logprobs[row, 2:6].numpy(), [-0.1, -0.2, -0.3, -0.4], rtol=1e-6
    )
    assert batch.behavior_logprobs[row, [0, 1, 6, 7]].abs().sum() == 0
    # column j scores token j+1: the scored targets are exactly the response tokens
    assert batch.target_ids[row, 2:6].tolist() == [20, 21, 22, 23]
    assert batch.advantages[row].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]


def test_padding_never_has_loss_mask_and_positions_count_real_tokens():
    batch = build_batch(
        [sample("a", [1, 2, 3], [4, 5, 6, 7]), sample("b", [1, 2], [9])], pad_token_id=2
    )
    pad = batch.attention_mask[:, 1:] == 0
    assert not (batch.loss_mask.bool() & pad).any()
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert batch.input_ids[1, 3:].tolist() == [2, 2, 2, 2]
    assert batch.position_ids[0].tolist() == list(range(7))
    assert batch.position_ids[1, :3].tolist() == [0, 1, 2]
    assert batch.temperatures[1, 2:].tolist() == [1.0] * 4


def test_observation_tokens_inside_the_response_keep_mask_zero():
    batch = build_batch(
        [sample("a", [1, 2], [5, 6, 7, 8, 9], mask=[1, 1, 0, 0, 1], advantage=-0.5, version=3)],
        pad_token_id=0,
    )
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 1]
    assert batch.advantages[0].tolist() == [0, -0.5, -0.5, 0, 0, -0.5]
    assert batch.policy_versions[0].tolist() == [-1, 3, 3, -1, -1, 3]
    assert batch.behavior_logprobs[0, 3:5].abs().sum() == 0


def test_micro_batches_are_cut_to_their_own_length_and_pad_multiple():
    batch = build_batch(
        [sample("a", [1] * 3, [2] * 30), sample("b", [1] * 3, [2] * 2), sample("c", [1], [2])],
        pad_token_id=0,
        pad_to_multiple_of=8,
    )
    assert batch.input_ids.shape[1] == 40
    parts = list(batch.micro_batches(2))
    assert [p.size for p in parts] == [2, 1]
    assert parts[0].input_ids.shape[1] == 40 and parts[1].input_ids.shape[1] == 8
    assert parts[1].loss_mask.shape[1] == 7 and parts[1].trajectory_ids == ("c",)
    assert torch.equal(parts[1].loss_mask[0, :1], torch.ones(1))
    with pytest.raises(ValueError):
        list(batch.micro_batches(0))


def test_misaligned_arrays_and_empty_prompts_are_rejected():
    with pytest.raises(ValueError):
        TrainSample(
            "x",
            np.array([1]),
            np.array([1, 2]),
            np.zeros(1, np.float32),
            np.ones(2, np.uint8),
            np.zeros(2, np.int64),
            np.ones(2, np.float32),
            0.0,
        )
    with pytest.raises(ValueError):
        sample("x", [], [1, 2])
    with pytest.raises(ValueError):
        build_batch([], pad_token_id=0)
