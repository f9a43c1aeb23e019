"""The engine's scheduler: one thread that owns the model and decodes all running requests together.

Consumes `RequestState`s (from `/generate`) and commands (pause, continue, abort, weight commit,
flush) submitted from the HTTP event loop. Produces finished requests, resolved on their asyncio
futures. Guarantees:
* continuous batching: requests join the running batch after a batched prefill (with prefix-cache
  reuse) and leave it when finished; every decode step runs all running requests at once;
* commands run only between two forward passes, so a weight swap is atomic with respect to tokens;
* each token is labelled with the weight version that computed it (`spans`);
* an abort returns every token generated so far with its log-prob (pitfalls C14, C15).

One loop iteration: take new requests and commands (intake.py), run commands that may run
(scheduler_commands.py), admit waiting requests (admission.py) and prefill them, run one decode
step (running_batch.py), finish requests that stopped (request_state.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from services.engine import metrics
from services.engine.admission import Admitted, select_prefill
from services.engine.graph_decode import GraphDecoder
from services.engine.intake import Intake
from services.engine.kv_batch import POOL, KVShape
from services.engine.prefix_cache import PrefixCache
from services.engine.protocol import RequestSpec
from services.engine.request_state import (
    ABORTED,
    RequestState,
    engine_error,
    finish,
    new_request_state,
    stop_reason,
)
from services.engine.running_batch import RunningBatch
from services.engine.scheduler_commands import SchedulerCommands

log = logging.getLogger(__name__)


class Scheduler(SchedulerCommands):
    """Owns the model, the running batch and the prefix cache (see the module docstring)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        weight_version: str,
        max_running_requests: int,
        max_prefill_tokens: int,
        prefix_cache: PrefixCache,
        eos_token_ids: set[int],
        fp32_lm_head: bool = False,
        graph: GraphDecoder | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.weight_version = weight_version
        self.max_running_requests, self.max_prefill_tokens = (
            max_running_requests,
            max_prefill_tokens,
        )
        self.prefix_cache, self.eos_token_ids = prefix_cache, eos_token_ids
        self.kv_shape = KVShape.of(model)
        self.paused: str | None = None
        self._intake = Intake()
        self._waiting: deque[RequestState] = deque()
        self._held: list[RequestState] = []  # arrived while paused
        self._batch = RunningBatch(
            model,
            self.kv_shape,
            prefix_cache,
            max_prefill_tokens=max_prefill_tokens,
            fp32_lm_head=fp32_lm_head,
            graph=graph,
        )
        metrics.DECODE_GRAPH_BYTES.set(graph.bytes if graph is not None else 0)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    # ----- called from the HTTP event loop ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._intake.wake.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop) -> RequestState:
        """Queue a request; its future resolves with the finished state. Raises DuplicateRequestId."""
        return self.submit_many([spec], loop)[0]

    def submit_many(
        self, specs: list[RequestSpec], loop: asyncio.AbstractEventLoop
    ) -> list[RequestState]:
        """Queue the requests of one /generate call, all or none: DuplicateRequestId if any rid is
        already live (nothing is queued then, so a refused batch disturbs no other request)."""
        device = self.kv_shape.device
        states = [new_request_state(spec, loop, self.tokenizer, device=device) for spec in specs]
        self._intake.submit(states)
        return states

    def call(
        self, fn: Callable[[], object], *, when_idle: bool = False
    ) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between two steps. `when_idle`: only once no request is
        running (new requests are not admitted meanwhile) unless generation is paused."""
        return self._intake.call(fn, when_idle)

    def loads(self) -> dict:
        return {
            "num_running_reqs": len(self._batch.live()),
            "num_waiting_reqs": len(self._waiting) + len(self._held),
            "paused": self.paused,
        }

    # ----- the loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        # Everything on this thread runs in inference mode: KV buffers are inference tensors, and
        # pooled ones are written again later (in-place updates need inference mode).
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while not self._stopping:
            self._intake.wake.clear()
            self._take_inbox()
            idle_pending = self._intake.run_commands(
                busy=lambda: bool(self._batch.live()) and self.paused is None
            )
            admitted = False if (self.paused or idle_pending) else self._admit()
            if self._batch.live() and self.paused is None:
                self._guarded(self._decode_step)
            elif not admitted:
                self._intake.wake.wait(0.5)
            metrics.RUNNING.set(len(self._batch.live()))
            metrics.WAITING.set(len(self._waiting) + len(self._held))
            metrics.PREFIX_CACHE_BYTES.set(self.prefix_cache.bytes)
            metrics.KV_BYTES.set(self._batch.bytes + POOL.bytes)
        for state in [*self._batch.live(), *self._waiting, *self._held]:
            self._finish(state, dict(ABORTED, message="engine shutting down"))

    def _take_inbox(self) -> None:
        arrived = self._intake.take_requests()
        (self._held if self.paused else self._waiting).extend(arrived)

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as exc:  # a failed forward fails its requests, never the engine
            log.exception("engine step failed")
            self._failed("decode", exc)
            for state in self._batch.live():
                if state.finish_reason is None:  # not one this step had finished already
                    self._finish(state, engine_error(exc))
            self._batch.clear()

    def _failed(self, stage: str, exc: Exception) -> None:
        """Count a failed forward; after a CUDA out-of-memory error also drop the prefix cache,
        the one memory the engine holds by choice (SGLang evicts its radix cache under memory
        pressure too), so that the next forward has it."""
        metrics.STEP_FAILURES.labels(stage, type(exc).__name__).inc()
        if isinstance(exc, torch.OutOfMemoryError):
            log.error(
                "CUDA out of memory: prefix cache emptied",
                extra={"stage": stage, "prefix_cache_bytes": self.prefix_cache.bytes},
            )
            self.prefix_cache.clear()

    # ----- prefill -----------------------------------------------------------------------------------

    def _admit(self) -> bool:
        """Prefill as many waiting requests as the running limit and the token budget allow."""
        group = select_prefill(
            self._waiting,
            self.max_running_requests - len(self._batch.live()),
            self.prefix_cache,
            self.max_prefill_tokens,
        )
        if not group:
            return False
        for state, *_ in group:
            self._waiting.remove(state)
        self._guarded_prefill(group)
        return True

    def _guarded_prefill(self, group: list[Admitted]) -> None:
        """`_prefill(group)`; if it raises, the group's requests end with an engine error and
        any of them that had already joined the running batch leave it. Before, a failure after
        the join (sampling the first token) left those rows live without a token, and the next
        decode step failed every running request with IndexError (seen on an H100 after CUDA
        out-of-memory errors, BENCHMARKS.md issue 33; tests/unit/test_engine_step_failures.py)."""
        try:
            self._prefill(group)
        except Exception as exc:  # a failed prefill ends its requests, never the scheduler
            log.exception("prefill failed")
            self._failed("prefill", exc)
            states = {id(state) for state, *_ in group}
            for state, *_ in group:
                if state.finish_reason is None:
                    self._finish(state, engine_error(exc))
            rows = self._batch.rows
            for row, state in enumerate(rows):
                if state is not None and id(state) in states:
                    rows[row] = None  # padding until the next compaction: no copy, no memory
            if rows and not self._batch.live():
                self._batch.clear()

    def _prefill(self, group: list[Admitted]) -> None:
        start = time.perf_counter()
        batch, logits = self._batch.prefill(group)
        metrics.PREFILL_SECONDS.observe(time.perf_counter() - start)
        states = [state for state, *_ in group]
        done = [row for row, s in enumerate(states) if s.spec.max_new_tokens <= len(s.output_ids)]
        for row in done:  # max_new_tokens == 0: prefill only (SGLang uses this to warm the cache)
            self._finish(states[row], {"type": "length", "length": states[row].spec.max_new_tokens})
        keep = [row for row in range(len(group)) if row not in done]
        if not keep:
            return
        if done:
            kept = batch.select(keep)
            batch.release()
            batch, states, logits = kept, [states[r] for r in keep], logits[keep]
        self._sample_and_finish(logits, first_row=self._batch.join(batch, states))

    # ----- decode ------------------------------------------------------------------------------------

    def _decode_step(self) -> None:
        start = time.perf_counter()
        logits = self._batch.decode()
        metrics.BATCH_SIZE.set(len(self._batch.live()))
        self._sample_and_finish(logits, first_row=0)
        metrics.DECODE_STEP_SECONDS.observe(time.perf_counter() - start)

    def _sample_and_finish(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample one token for running rows [first_row, first_row + len(logits)), then retire finished rows."""
        sampled = self._batch.sample(logits, first_row)
        finished = []
        for row, state, token, logprob in sampled:
            state.append(token, logprob, self.weight_version)
            reason = stop_reason(state, self.tokenizer, self.eos_token_ids)
            if reason is not None:
                self._batch.offer_to_prefix_cache(state, row)
                self._finish(state, reason)
                finished.append(row)
        metrics.GENERATION_TOKENS.inc(len(sampled))
        self._drop_rows(finished)

    # ----- bookkeeping -------------------------------------------------------------------------------

    def _drop_rows(self, rows: list[int]) -> None:
        """Retire finished rows; an idle engine (none running or waiting) gives pooled KV back."""
        self._batch.retire(rows)
        if not self._batch.rows and not self._waiting:
            POOL.clear()

    def _finish(self, state: RequestState, reason: dict) -> None:
        self._intake.release(state.spec.rid)
        finish(state, reason, self.weight_version)
