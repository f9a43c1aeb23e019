import numpy as np
import pytest

from shellrl.rl.advantages import group_advantages
from shellrl.rl.staleness import fresh_token_mask, is_too_stale, max_admitted_groups, staleness


def test_alternating_rewards_give_plus_minus_one():
    out = group_advantages([1, 0, 1, 0])
    np.testing.assert_allclose(out.advantages, [1, -1, 1, -1], atol=1e-3)
    assert not out.zero_variance


def test_equal_rewards_give_zero_advantages_and_are_flagged():
    out = group_advantages([1, 1, 1, 1])
    assert out.zero_variance
    assert np.array_equal(out.advantages, np.zeros(4, dtype=np.float32))
    assert group_advantages([0.1, 0.1, 0.1]).zero_variance


def test_one_success_of_four_uses_population_std():
    out = group_advantages([1, 0, 0, 0])
    np.testing.assert_allclose(out.advantages, [1.7317, -0.5772, -0.5772, -0.5772], atol=1e-4)
    assert out.reward_std == pytest.approx(0.4330, abs=1e-4)


def test_reference_values_of_pitfall_c10():
    np.testing.assert_allclose(
        group_advantages([1, 1, 0, 0]).advantages, [0.99980] * 2 + [-0.99980] * 2, atol=1e-5
    )
    np.testing.assert_allclose(
        group_advantages([1, 1, 2]).advantages, [-0.70696, -0.70696, 1.41391], atol=1e-5
    )
    assert abs(float(group_advantages([1, 0, 0, 0]).advantages.sum())) < 1e-6


def test_non_finite_or_empty_rewards_are_rejected():
    with pytest.raises(ValueError):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError):
        group_advantages([])


def test_staleness_bound_is_inclusive_and_zero_means_on_policy():
    assert staleness(13, 10) == 3
    assert is_too_stale(13, 10, max_staleness=1)
    assert not is_too_stale(11, 10, max_staleness=1)
    assert is_too_stale(11, 10, max_staleness=0)
    assert not is_too_stale(10, 10, max_staleness=0)
    with pytest.raises(ValueError):
        is_too_stale(1, 1, -1)


def test_admission_bound_and_fresh_tokens():
    assert max_admitted_groups(learner_version=2, max_staleness=1, groups_per_step=4) == 16
    assert fresh_token_mask(np.array([-1, 3, 2, 3]), 3).tolist() == [False, True, False, True]
