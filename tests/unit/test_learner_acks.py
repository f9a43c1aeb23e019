"""services/learner/acks.py: an entry is acknowledged only with the checkpoint after the step that
resolved it, and a resolved trajectory id is remembered (bounded) so it never trains twice."""

from __future__ import annotations

from services.learner.acks import AckLedger


def test_resolved_entries_are_handed_over_once_in_order_for_the_next_checkpoint():
    acks = AckLedger()
    acks.resolve("t-1", "1-0", step=1)
    acks.resolve("t-2", "2-0", step=1)
    acks.wait_for_checkpoint("3-0")  # a duplicate of a resolved trajectory
    assert acks.take_unacked() == ["1-0", "2-0", "3-0"]
    assert acks.take_unacked() == []
    assert acks.resolved_by("t-1") == 1 and acks.resolved_by("t-2") == 1


def test_a_duplicate_waiting_for_a_checkpoint_is_not_remembered_as_a_trajectory():
    acks = AckLedger()
    acks.wait_for_checkpoint("9-0")
    assert acks.consumed == {} and acks.unacked == ["9-0"]


def test_only_the_newest_kept_trajectory_ids_are_remembered():
    acks = AckLedger(kept=2)
    for i in range(4):
        acks.resolve(f"t-{i}", f"{i}-0", step=i + 1)
    assert list(acks.consumed) == ["t-2", "t-3"]
    assert acks.resolved_by("t-0") is None and acks.resolved_by("t-3") == 4
    assert acks.take_unacked() == ["0-0", "1-0", "2-0", "3-0"]  # forgetting never drops an ack


def test_restore_gives_every_id_of_the_checkpoint_its_step_even_step_zero():
    acks = AckLedger()
    acks.restore(["t-a", "t-b"], step=0)
    assert acks.resolved_by("t-a") == 0 and acks.checkpointed_step == 0
    acks.restore(["t-c"], step=7)
    assert acks.resolved_by("t-a") is None and acks.resolved_by("t-c") == 7
    assert acks.checkpointed_step == 7
