"""When the learner may acknowledge a stream entry (worker.py's guarantee): only after a durable
checkpoint includes the step that resolved it (trained it, or dropped it), and a trajectory id
resolved once is never trained again.

`AckLedger` keeps the entries resolved since the last checkpoint (`take_unacked` hands them over
once that checkpoint is written) and the newest `kept` trajectory ids with the step that resolved
each (a checkpoint stores them; `restore` reads them back after a restart, so an entry re-read
from the stream is skipped, and acknowledged at once when the checkpoint already covers it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

CONSUMED_IDS_KEPT = 200_000


class AckLedger:
    """Resolved trajectory ids and the entries waiting for a checkpoint. Steps are policy
    versions: an entry resolved while step k trains is covered by a checkpoint of step >= k."""

    def __init__(self, kept: int = CONSUMED_IDS_KEPT) -> None:
        self.consumed: OrderedDict[str, int] = OrderedDict()  # trajectory id -> resolving step
        self.unacked: list[str] = []  # entry ids resolved since the last checkpoint
        self.checkpointed_step = 0  # the step of the last durable checkpoint
        self.kept = kept

    def resolve(self, trajectory_id: str, entry_id: str, step: int) -> None:
        """Trajectory `trajectory_id` (stream entry `entry_id`) is resolved by `step`: never
        trained again, its entry acknowledged with the first checkpoint of `step` or later."""
        self.consumed[trajectory_id] = step
        self.unacked.append(entry_id)
        while len(self.consumed) > self.kept:
            self.consumed.popitem(last=False)

    def wait_for_checkpoint(self, entry_id: str) -> None:
        """Acknowledge entry `entry_id` (a duplicate of a resolved trajectory) with the next
        checkpoint."""
        self.unacked.append(entry_id)

    def resolved_by(self, trajectory_id: str) -> int | None:
        """The step that resolved `trajectory_id`; None when it is not (or no longer) known."""
        return self.consumed.get(trajectory_id)

    def take_unacked(self) -> list[str]:
        """The entries a checkpoint just written covers (every one resolved since the last), in
        the order they were resolved; the ledger then holds none."""
        taken, self.unacked = self.unacked, []
        return taken

    def restore(self, consumed_ids: Iterable[str], step: int) -> None:
        """The ledger of a checkpoint of `step` (after a restart): its consumed trajectory ids."""
        self.consumed = OrderedDict((t, step) for t in consumed_ids)
        self.checkpointed_step = step
