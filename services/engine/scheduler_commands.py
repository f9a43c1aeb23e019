"""The commands of the engine's scheduler that change what runs: pause (abort | retract | in_place),
resume, abort by rid, flush the prefix cache, swap weights. They run on the scheduler thread
through `Scheduler.call`, between two forward passes, so they never race a step.

`SchedulerCommands` is mixed into `Scheduler` (scheduler.py), as SGLang splits its scheduler
(managers/scheduler_update_weights_mixin.py); it acts on the scheduler's queues, running batch and
prefix cache, and uses its `_take_inbox`, `_finish` and `_drop_rows`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services.engine.intake import Intake
from services.engine.prefix_cache import PrefixCache
from services.engine.request_state import ABORTED, ABORTED_IN_QUEUE, RequestState
from services.engine.running_batch import RunningBatch

PAUSE_MODES = ("abort", "retract", "in_place")


class SchedulerCommands:
    """pause, resume, abort_exact, abort, flush_cache, set_weights (see the module docstring)."""

    paused: str | None
    weight_version: str
    prefix_cache: PrefixCache
    _intake: Intake
    _batch: RunningBatch
    _waiting: deque[RequestState]
    _held: list[RequestState]  # arrived while paused

    def pause(self, mode: str) -> None:
        """abort: running and queued requests return now with finish_reason abort and their partial
        output. retract: running requests go back to the queue keeping their output; they resume after
        `resume`, re-prefilled under the weights of that time. in_place: stepping stops, KV is kept.
        In every mode, requests that arrive while paused wait for `resume`."""
        self.paused = mode
        if mode == "abort":
            self.abort(rid="", abort_all=True)
        elif mode == "retract":
            for row, state in enumerate(self._batch.rows):
                if state is not None:
                    self._batch.offer_to_prefix_cache(state, row)
                    state.num_retractions += 1
            self._waiting.extendleft(reversed(self._batch.live()))
            self._batch.clear()

    def resume(self) -> None:
        self.paused = None
        self._waiting.extend(self._held)
        self._held = []

    def abort_exact(self, rids: set[str]) -> int:
        """Abort exactly these rids (no prefix matching): shellrl's own aborts, e.g. for a client
        that disconnected, must not touch another client's rid that merely starts the same way."""
        return self._abort_where(lambda state: state.spec.rid in rids)

    def abort(self, rid: str, abort_all: bool) -> int:
        """Abort all requests, or those whose rid starts with `rid` provided a request with exactly
        that rid is live: SGLang 0.5.23 drops an abort whose rid is not in flight
        (managers/tokenizer_manager.py:abort_request), and its scheduler then matches by prefix
        (managers/scheduler.py:abort_request). So a batch parent rid aborts nothing. Returns count."""
        if not abort_all and not (rid and self._intake.is_live(rid)):
            return 0
        return self._abort_where(lambda state: abort_all or state.spec.rid.startswith(rid))

    def _abort_where(self, hit: Callable[[RequestState], bool]) -> int:
        self._take_inbox()  # a request submitted after this round's intake is aborted too, not missed
        count = 0
        for queue in (self._waiting, self._held):
            for state in [s for s in queue if hit(s)]:
                queue.remove(state)
                state.aborted_in_queue = not state.output_ids
                self._finish(state, dict(ABORTED if state.output_ids else ABORTED_IN_QUEUE))
                count += 1
        rows = [i for i, s in enumerate(self._batch.rows) if s is not None and hit(s)]
        for row in rows:
            self._batch.offer_to_prefix_cache(self._batch.rows[row], row)
            self._finish(self._batch.rows[row], dict(ABORTED))
        self._drop_rows(rows)
        return count + len(rows)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are running, or waiting unless the
        engine is paused, as SGLang (managers/scheduler.py:flush_cache, is_fully_idle)."""
        if self._batch.live() or (self._waiting and not self.paused):
            return False
        self.prefix_cache.clear()
        return True

    def set_weights(self, apply: Callable[[], object], weight_version: str | None) -> None:
        """Swap weights (`apply`), set the version, drop the prefix cache (its KV is stale)."""
        apply()
        if weight_version is not None:
            self.weight_version = weight_version
        self.prefix_cache.clear()
