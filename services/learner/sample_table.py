"""Sampled episodes of a learner step, as a table for the experiment tracker.

Every `interval_steps` steps the learner logs `rows` episodes of the groups that step took (one
member of each group, groups in order, then a second member of each ...) as the tracker table
"samples": the task, the reward the learner trained on and the verifier's, the prompt's end and
the transcript (the agent's actions and the tool outputs between them, decoded). What users of
TRL and verl read to see what the policy does, beside the curves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.learner.group_assembler import RolloutGroup
from shellrl.contract import decode_token_ids

COLUMNS = ("group_id", "task_id", "training_reward", "reward", "turns", "prompt", "transcript")


@dataclass(frozen=True)
class SampleTable:
    """decode: token ids -> text (the tokenizer's, special tokens skipped); interval_steps: a
    table every N steps (0: never); rows: episodes per table; max_chars: of the prompt (its end)
    and of the transcript (its start)."""

    decode: Callable[[Sequence[int]], str]
    interval_steps: int = 1
    rows: int = 4
    max_chars: int = 2000

    def due(self, step: int) -> bool:
        return self.interval_steps > 0 and step % self.interval_steps == 0

    def table(self, groups: Sequence[RolloutGroup]) -> list[tuple]:
        """Up to `rows` rows (COLUMNS) of `groups`' members, taken round-robin over the groups."""
        members = [g.members for g in groups]
        picked = []
        for i in range(max((len(m) for m in members), default=0)):
            picked += [m[i] for m in members if i < len(m)]
        return [self.row(m.trajectory) for m in picked[: self.rows]]

    def row(self, traj) -> tuple:
        prompt = self.decode(decode_token_ids(traj.prompt_ids).tolist())
        transcript = "".join(
            self.decode(decode_token_ids(s.token_ids).tolist()) for s in traj.segments
        )
        return (
            traj.group_id,
            traj.task_id,
            round(traj.training_reward, 4),
            round(traj.reward, 4),
            traj.num_turns,
            prompt[-self.max_chars :],
            transcript[: self.max_chars],
        )
