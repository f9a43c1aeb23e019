import math

import numpy as np
import pytest

from services.learner.group_assembler import GroupAssembler
from services.learner.train_samples import group_samples, token_temperatures
from shellrl.contract import Failure
from tests.helpers.trajectories import make_trajectory


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def assembler(**kw):
    clock = Clock()
    kw.setdefault("group_timeout_s", 10.0)
    kw.setdefault("max_staleness", 1)
    return GroupAssembler(clock=clock, **kw), clock


def test_group_is_released_when_all_members_arrived():
    a, _ = assembler()
    for i, r in enumerate([1, 0, 1]):
        assert a.add(f"e{i}", make_trajectory("g", r), learner_version=0) is None
    assert a.pop_ready(0) == []
    a.add("e3", make_trajectory("g", 0), 0)
    (group,) = a.pop_ready(0)
    assert len(group.members) == 4 and not group.timed_out and group.trainable
    samples = group_samples(group)
    np.testing.assert_allclose([s.advantage for s in samples.samples], [1, -1, 1, -1], atol=1e-3)
    assert a.pending_groups == 0


def test_infra_failures_leave_the_group_and_the_rest_is_used():
    a, clock = assembler()
    a.add("e0", make_trajectory("g", 1), 0)
    a.add("e1", make_trajectory("g", 0), 0)
    a.add("e2", make_trajectory("g", 0, failure=Failure.FAILURE_INFRA_SANDBOX), 0)
    a.add(
        "e3",
        make_trajectory("g", math.nan, scored=False, failure=Failure.FAILURE_INFRA_VERIFIER),
        0,
    )
    assert a.pop_ready(0) == []  # the sandbox failure is re-run by the gateway: wait for the retry
    clock.now = 10.0
    (group,) = a.pop_ready(0)
    assert len(group.members) == 2 and group.timed_out and group.counts
    assert sorted(d.reason for d in group.dropped) == ["infra_failure", "verifier_failure"]
    assert sorted(group.entry_ids) == ["e0", "e1", "e2", "e3"]
    advantages = [s.advantage for s in group_samples(group).samples]
    np.testing.assert_allclose(advantages, [0.9998, -0.9998], atol=1e-4)  # never scored 0


def test_timeout_uses_two_valid_members_and_drops_a_lonely_one():
    a, clock = assembler()
    a.add("e0", make_trajectory("g", 1), 0)
    a.add("e1", make_trajectory("g", 0), 0)
    a.add("x0", make_trajectory("h", 1), 0)
    clock.now = 9.9
    assert a.pop_ready(0) == []
    clock.now = 10.0
    g, h = a.pop_ready(0)
    assert g.timed_out and len(g.members) == 2
    assert h.members == () and [d.reason for d in h.dropped] == ["group_too_small"] and not h.counts
    late = a.add("e2", make_trajectory("g", 1), 0)
    assert late.reason == "late_member"


def test_staleness_is_checked_on_arrival_and_again_at_release():
    a, _ = assembler(max_staleness=1)
    dropped = a.add("e0", make_trajectory("g", 1, group_size=3, version=10), learner_version=13)
    assert dropped is None  # held as a dropped member of its group
    a.add("e1", make_trajectory("g", 0, group_size=3, version=12), learner_version=13)
    a.add("e2", make_trajectory("g", 1, group_size=3, version=13), learner_version=13)
    (group,) = a.pop_ready(learner_version=14)  # the learner moved on while the group waited
    reasons = sorted((d.reason, d.staleness) for d in group.dropped)
    assert reasons == [("group_too_small", None), ("stale", 2), ("stale", 3)]
    assert group.members == () and group.counts  # the gateway counted it: it uses a step slot


def test_on_policy_bound_zero_keeps_only_the_current_version():
    a, _ = assembler(max_staleness=0)
    a.add("e0", make_trajectory("g", 1, group_size=2, version=5), 5)
    a.add("e1", make_trajectory("g", 0, group_size=2, version=4), 5)
    (group,) = a.pop_ready(5)
    assert [d.reason for d in group.dropped] == ["stale", "group_too_small"]


def test_duplicates_nan_rewards_eval_and_empty_responses_are_dropped_with_reasons():
    a, _ = assembler()
    t = make_trajectory("g", 1, group_size=4)
    a.add("e0", t, 0)
    assert a.add("e0b", t, 0).reason == "duplicate"
    a.add("e1", make_trajectory("g", math.nan, group_size=4), 0)
    ev = make_trajectory("g", 1, group_size=4)
    ev.eval = True
    a.add("e2", ev, 0)
    a.add("e3", make_trajectory("g", 0, group_size=4, actions=((),)), 0)
    a.add("e4", make_trajectory("g", 0, group_size=4, scored=False), 0)
    (group,) = a.pop_ready(0)
    assert sorted(d.reason for d in group.dropped) == [
        "empty_response",
        "eval",
        "group_too_small",
        "nan_reward",
        "unscored",
    ]


def test_equal_rewards_are_flagged_zero_variance():
    a, _ = assembler()
    for i in range(4):
        a.add(f"e{i}", make_trajectory("g", 1), 0)
    (group,) = a.pop_ready(0)
    out = group_samples(group)
    assert out.zero_variance and all(s.advantage == 0 for s in out.samples)


def test_token_temperatures_follow_the_segments_or_a_fixed_override():
    t = make_trajectory("g", 1, actions=((1, 2), (3,)), observations=((9, 9, 9),), temperature=0.6)
    assert token_temperatures(t).tolist() == pytest.approx([0.6, 0.6, 1.0, 1.0, 1.0, 0.6])
    assert token_temperatures(t, fixed_temperature=0.8).tolist() == pytest.approx(
        [0.8, 0.8, 1, 1, 1, 0.8]
    )


def test_released_group_ids_survive_a_restore():
    a, _ = assembler()
    a.add("e0", make_trajectory("g", 1, group_size=1), 0)
    a.pop_ready(0)
    b, _ = assembler()
    b.restore_released(a.released_group_ids())
    assert b.add("e1", make_trajectory("g", 0), 0).reason == "late_member"


def test_an_infra_failure_and_its_retry_make_one_sample():
    a, _ = assembler()
    a.add("e0", make_trajectory("g", 1, group_size=2, trajectory_id="g-0-a0"), 0)
    a.add(
        "e1",
        make_trajectory(
            "g", 0, group_size=2, trajectory_id="g-1-a0", failure=Failure.FAILURE_INFRA_ENGINE
        ),
        0,
    )
    assert a.pop_ready(0) == []
    a.add("e2", make_trajectory("g", 0, group_size=2, trajectory_id="g-1-a1"), 0)
    (group,) = a.pop_ready(0)
    assert [m.trajectory_id for m in group.members] == ["g-0-a0", "g-1-a1"] and not group.timed_out


def test_a_group_with_one_usable_sample_does_not_count_toward_a_step():
    a, clock = assembler()
    a.add("e0", make_trajectory("g", 1, group_size=2), 0)
    a.add("e1", make_trajectory("g", 0, group_size=2, failure=Failure.FAILURE_INFRA_SANDBOX), 0)
    clock.now = 10.0
    (group,) = a.pop_ready(0)
    assert not group.counts and not group.trainable


def test_a_released_group_is_rechecked_for_staleness_when_it_is_finally_trained():
    a, _ = assembler(max_staleness=1)
    for i in range(2):
        a.add(f"e{i}", make_trajectory("g", i, group_size=2, version=3), 3)
    (group,) = a.pop_ready(4)
    assert group.trainable
    later = a.recheck(group, 5)  # it waited one step in the ready queue
    assert not later.trainable and sorted(d.reason for d in later.dropped) == ["stale", "stale"]
    assert sorted(later.entry_ids) == ["e0", "e1"]


def test_the_same_entry_delivered_twice_while_held_is_ignored():
    a, _ = assembler()
    t = make_trajectory("g", 1, group_size=2)
    a.add("e0", t, 0)
    assert a.add("e0", t, 0) is None and a.pending_trajectories == 1


def test_overlong_filtering_masks_only_the_sample_cut_by_the_length_limit():
    # known_pitfalls C06: max_new_tokens 8; s2 ends with EOS exactly at the limit (a stop, not a cut)
    from shellrl.contract import FinishReason

    a, _ = assembler()
    lengths, reasons = (
        [5, 8, 8, 3],
        [
            FinishReason.FINISH_REASON_STOP,
            FinishReason.FINISH_REASON_STOP,
            FinishReason.FINISH_REASON_LENGTH,
            FinishReason.FINISH_REASON_STOP,
        ],
    )
    for i, (n, reason) in enumerate(zip(lengths, reasons)):
        t = make_trajectory("g", [1, 0, 0, 1][i], actions=(tuple(range(10, 10 + n)),))
        t.segments[0].finish_reason = reason
        a.add(f"e{i}", t, 0)
    (group,) = a.pop_ready(0)
    on = group_samples(group, overlong_filtering=True)
    off = group_samples(group)
    assert [int(s.loss_mask.sum()) for s in on.samples] == [5, 8, 0, 3]
    assert [int(s.loss_mask.sum()) for s in off.samples] == [5, 8, 8, 3]
    assert [s.advantage for s in on.samples] == [
        s.advantage for s in off.samples
    ]  # still in the baseline


def test_nan_rewards_leave_the_group_and_the_valid_pair_gets_plus_minus_one():
    # known_pitfalls C12: g1 = [1, NaN, 0, NaN] -> [0.9998, -0.9998]; g3 all NaN -> dropped
    a, _ = assembler()
    for i, r in enumerate([1.0, math.nan, 0.0, math.nan]):
        a.add(f"a{i}", make_trajectory("g1", r), 0)
    for i in range(4):
        a.add(f"c{i}", make_trajectory("g3", math.nan), 0)
    g1, g3 = a.pop_ready(0)
    np.testing.assert_allclose(
        [s.advantage for s in group_samples(g1).samples], [0.9998, -0.9998], atol=1e-4
    )
    assert not g3.trainable and [d.reason for d in g3.dropped].count("nan_reward") == 4


def test_a_verifier_failure_is_never_re_run_so_its_group_is_complete_without_waiting():
    """Chaos found groups holding verifier failures waiting the whole group timeout (900 s) for
    re-runs the gateway never sends (issue 15 item 8): such a member has arrived for good."""
    a, clock = assembler()
    a.add("e0", make_trajectory("g", 1), 0)
    a.add("e1", make_trajectory("g", 0), 0)
    a.add("e2", make_trajectory("g", 1), 0)
    a.add(
        "e3",
        make_trajectory("g", math.nan, scored=False, failure=Failure.FAILURE_INFRA_VERIFIER),
        0,
    )
    (group,) = a.pop_ready(0)  # at once, clock still 0
    assert not group.timed_out and len(group.members) == 3 and group.counts
    assert [d.reason for d in group.dropped] == ["verifier_failure"]

    b, _ = assembler()
    b.add("f0", make_trajectory("h", 1), 0)
    for i in range(1, 4):
        b.add(
            f"f{i}",
            make_trajectory("h", math.nan, scored=False, failure=Failure.FAILURE_INFRA_VERIFIER),
            0,
        )
    (lonely,) = b.pop_ready(0)  # complete, and with one usable member it counts toward no step
    assert not lonely.timed_out and not lonely.counts and lonely.members == ()


def test_a_non_finite_or_positive_behavior_logprob_on_a_scored_token_drops_only_that_trajectory():
    """Issue 15 item 4: one NaN behavior log-prob used to make the whole step skip. Such a
    trajectory (NaN, +-inf or > 0 on a loss-mask-1 token) is dropped as "invalid_logprobs" and
    counted; the rest of the group trains. A NaN on a loss-mask-0 token is never read."""
    from services.learner.group_assembler import DROP_REASONS

    a, _ = assembler()
    bad_lps = {"e2": math.nan, "e3": 0.5, "e4": -math.inf, "e5": math.inf}
    fine = make_trajectory("g", 0, group_size=6, actions=((10, 11), (12,)), logprob=0.0)  # p = 1
    fine.segments[1].logprobs = np.array([math.nan], dtype=np.float32).tobytes()  # mask-0 token
    a.add("e0", make_trajectory("g", 1, group_size=6), 0)
    a.add("e1", fine, 0)
    for i, (entry, lp) in enumerate(bad_lps.items()):
        t = make_trajectory("g", i % 2, group_size=6, actions=((10, 11, 12),))
        lps = np.full(3, -0.7, dtype=np.float32)
        lps[1] = lp  # one scored token of three
        t.segments[0].logprobs = lps.tobytes()
        assert a.add(entry, t, 0) is None  # held as a dropped member of its group
    (group,) = a.pop_ready(0)  # complete: a dropped member has arrived, no re-run follows
    assert not group.timed_out and group.trainable and group.counts
    assert [d.reason for d in group.dropped] == ["invalid_logprobs"] * 4
    assert "invalid_logprobs" in DROP_REASONS  # the worker counts each drop under its reason
    samples = group_samples(group).samples
    np.testing.assert_allclose([s.advantage for s in samples], [0.9998, -0.9998], atol=1e-4)
    scored = np.concatenate([s.behavior_logprobs[s.loss_mask == 1] for s in samples])
    assert scored.tolist() == [-1.0, -1.0, 0.0, 0.0, 0.0]
