"""The learner's table of sampled episodes (services/learner/sample_table.py): which members of a
step's groups it shows, and what each row holds, decoded with a real tokenizer-like decode."""

from __future__ import annotations

from services.learner.group_assembler import GroupAssembler
from services.learner.sample_table import COLUMNS, SampleTable
from tests.helpers.trajectories import make_trajectory


def released(group_id: str, rewards: list[float]):
    assembler = GroupAssembler(group_timeout_s=10.0, max_staleness=1)
    for i, reward in enumerate(rewards):
        traj = make_trajectory(
            group_id,
            reward,
            group_size=len(rewards),
            prompt=(1, 2),
            actions=((10, 11), (12,)),
            observations=((20,),),
        )
        assembler.add(f"{group_id}-{i}", traj, 0)
    (group,) = assembler.pop_ready(0)
    return group


def decode(ids) -> str:  # replaces the tokenizer: token 10 -> "<10>"
    return "".join(f"<{i}>" for i in ids)


def test_rows_take_one_member_of_each_group_before_a_second():
    groups = [released("a", [1, 0, 1, 0]), released("b", [0, 0])]
    rows = SampleTable(decode, rows=3).table(groups)
    assert [r[0] for r in rows] == ["a", "b", "a"]
    assert [r[2] for r in rows] == [1.0, 0.0, 0.0]


def test_a_row_holds_the_task_rewards_prompt_and_transcript():
    (row,) = SampleTable(decode, rows=1, max_chars=12).table([released("a", [1, 0])])
    values = dict(zip(COLUMNS, row))
    assert values["task_id"] == "task-a" and values["reward"] == 1.0
    assert values["prompt"] == "<1><2>"
    # actions and the tool output between them, in order, cut to max_chars
    assert values["transcript"] == "<10><11><20>"


def test_the_table_is_due_every_interval_steps():
    table = SampleTable(decode, interval_steps=5)
    assert [s for s in range(1, 12) if table.due(s)] == [5, 10]
    assert not any(SampleTable(decode, interval_steps=0).due(s) for s in range(1, 12))
