"""The engine's scheduler: one thread that owns the model and decodes all running requests together.

Consumes `RequestState`s (from `/generate`) and commands (pause, continue, abort, weight commit,
flush) submitted from the HTTP event loop. Produces finished requests, resolved on their asyncio
futures. Guarantees:
* continuous batching: requests join the running batch after a batched prefill (with prefix-cache
  reuse) and leave it when finished; every decode step runs all running requests at once;
* commands run only between two forward passes, so a weight swap is atomic with respect to tokens;
* each token is labelled with the weight version that computed it (`spans`);
* an abort returns every token generated so far with its log-prob (pitfalls C14, C15).

One loop iteration: take new requests and commands, run commands that may run, admit waiting
requests (prefill), run one decode step, finish requests that stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engine import metrics
from services.engine.kv_batch import POOL, BatchKV, KVShape, forward_columns
from services.engine.prefix_cache import PrefixCache
from services.engine.protocol import RequestSpec
from services.engine.sampling import sample_next

log = logging.getLogger(__name__)

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_IN_QUEUE = {"type": "abort", "message": "Abort in waiting queue"}
PAUSE_MODES = ("abort", "retract", "in_place")
# A waiting request that shares this many uncached prefix tokens with one being prefilled waits one
# round and then reuses that prefix from the cache (SGLang's in-batch prefix caching does the same).
IN_BATCH_PREFIX_MIN_TOKENS = 32
# Finished rows stay in the batch as padding (a few wasted rows per step) until this many, or as
# many as the live rows, have piled up; compacting copies every live row's KV.
COMPACT_MIN_DEAD_ROWS = 8


class DuplicateRequestId(ValueError):
    pass


@dataclass(eq=False)
class RequestState:
    """A request's progress. Mutated only by the scheduler thread after `submit`."""

    spec: RequestSpec
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    created_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)  # [weight_version, start, end) over output tokens
    finish_reason: dict | None = None
    cached_tokens: int = 0
    num_retractions: int = 0
    aborted_in_queue: bool = False
    e2e_latency_s: float = 0.0
    weight_version_at_end: str = ""
    stop_window_tokens: int = 0
    generator: torch.Generator | None = None
    kv_generation: int = -1  # prefix-cache generation its KV belongs to
    kv_inserted: int = 0  # tokens of its sequence already offered to the prefix cache

    def tokens(self) -> list[int]:
        return [*self.spec.input_ids, *self.output_ids]


@dataclass
class _Command:
    fn: Callable[[], object]
    result: concurrent.futures.Future
    when_idle: bool


class Scheduler:
    """Owns the model, the running batch and the prefix cache (see the module docstring)."""

    def __init__(self, model, tokenizer, *, weight_version: str, max_running_requests: int,
                 max_prefill_tokens: int, prefix_cache: PrefixCache, eos_token_ids: set[int],
                 fp32_lm_head: bool = False) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.fp32_lm_head = fp32_lm_head
        self.weight_version = weight_version
        self.max_running_requests, self.max_prefill_tokens = max_running_requests, max_prefill_tokens
        self.prefix_cache, self.eos_token_ids = prefix_cache, eos_token_ids
        self.kv_shape = KVShape.of(model)
        self.paused: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[RequestState] = []
        self._commands: list[_Command] = []
        self._rids: set[str] = set()
        self._waiting: deque[RequestState] = deque()
        self._held: list[RequestState] = []  # arrived while paused
        self._running: list[RequestState | None] = []  # batch rows; None = finished, awaiting compaction
        self._batch: BatchKV | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    # ----- called from the HTTP event loop ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop) -> RequestState:
        """Queue a request; its future resolves with the finished state. Raises DuplicateRequestId."""
        return self.submit_many([spec], loop)[0]

    def submit_many(self, specs: list[RequestSpec], loop: asyncio.AbstractEventLoop) -> list[RequestState]:
        """Queue the requests of one /generate call, all or none: DuplicateRequestId if any rid is
        already live (nothing is queued then, so a refused batch disturbs no other request)."""
        states = [self._new_state(spec, loop) for spec in specs]
        with self._lock:
            for spec in specs:
                if spec.rid in self._rids:
                    raise DuplicateRequestId(f"Duplicate request ID detected: {spec.rid}")
            self._rids.update(spec.rid for spec in specs)
            self._inbox.extend(states)
        self._wake.set()
        return states

    def _new_state(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop) -> RequestState:
        state = RequestState(spec, loop.create_future(), loop)
        # The tail decoded for stop strings: a generated stop string can be split into more tokens than
        # its own encoding (e.g. "yyyyyy" generated as 6 tokens, encoded as 2; "。" as its 3 byte
        # tokens, encoded as 1); every byte-level BPE token holds at least one byte, so its UTF-8 length
        # + 1 tokens always hold it. SGLang also searches the whole decoded text
        # (Req._check_str_based_finish).
        state.stop_window_tokens = 1 + max(
            (max(len(s.encode("utf-8")), len(self.tokenizer.encode(s, add_special_tokens=False)))
             for s in spec.stop_strings), default=0)
        if spec.stop_regex:
            state.stop_window_tokens = max(state.stop_window_tokens, 64)
        if spec.sampling.seed is not None:
            state.generator = torch.Generator(device=self.kv_shape.device).manual_seed(spec.sampling.seed)
        return state

    def call(self, fn: Callable[[], object], *, when_idle: bool = False) -> concurrent.futures.Future:
        """Run `fn` on the scheduler thread between two steps. `when_idle`: only once no request is
        running (new requests are not admitted meanwhile) unless generation is paused."""
        command = _Command(fn, concurrent.futures.Future(), when_idle)
        with self._lock:
            self._commands.append(command)
        self._wake.set()
        return command.result

    def loads(self) -> dict:
        return {"num_running_reqs": len(self._live()), "num_waiting_reqs": len(self._waiting) + len(self._held),
                "paused": self.paused}

    # ----- commands (run on the scheduler thread through `call`) -----------------------------------

    def pause(self, mode: str) -> None:
        """abort: running and queued requests return now with finish_reason abort and their partial
        output. retract: running requests go back to the queue keeping their output; they resume after
        `resume`, re-prefilled under the weights of that time. in_place: stepping stops, KV is kept.
        In every mode, requests that arrive while paused wait for `resume`."""
        self.paused = mode
        if mode == "abort":
            self.abort(rid="", abort_all=True)
        elif mode == "retract":
            for row, state in enumerate(self._running):
                if state is not None:
                    self._offer_to_prefix_cache(state, row)
                    state.num_retractions += 1
            self._waiting.extendleft(reversed(self._live()))
            self._set_batch(None, [])

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
        if not abort_all:
            with self._lock:
                live = bool(rid) and rid in self._rids
            if not live:
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
        rows = [i for i, s in enumerate(self._running) if s is not None and hit(s)]
        for row in rows:
            self._offer_to_prefix_cache(self._running[row], row)
            self._finish(self._running[row], dict(ABORTED))
        self._drop_rows(rows)
        return count + len(rows)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are running, or waiting unless the
        engine is paused, as SGLang (managers/scheduler.py:flush_cache, is_fully_idle)."""
        if self._live() or (self._waiting and not self.paused):
            return False
        self.prefix_cache.clear()
        return True

    def set_weights(self, apply: Callable[[], object], weight_version: str | None) -> None:
        """Swap weights (`apply`), set the version, drop the prefix cache (its KV is stale)."""
        apply()
        if weight_version is not None:
            self.weight_version = weight_version
        self.prefix_cache.clear()

    # ----- the loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        # Everything on this thread runs in inference mode: KV buffers are inference tensors, and
        # pooled ones are written again later (in-place updates need inference mode).
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._take_inbox()
            idle_pending = self._run_commands()
            admitted = False if (self.paused or idle_pending) else self._admit()
            if self._live() and self.paused is None:
                self._guarded(self._decode_step)
            elif not admitted:
                self._wake.wait(0.5)
            metrics.RUNNING.set(len(self._live()))
            metrics.WAITING.set(len(self._waiting) + len(self._held))
            metrics.PREFIX_CACHE_BYTES.set(self.prefix_cache.bytes)
            metrics.KV_BYTES.set((self._batch.bytes if self._batch is not None else 0) + POOL.bytes)
        for state in [*self._live(), *self._waiting, *self._held]:
            self._finish(state, dict(ABORTED, message="engine shutting down"))

    def _take_inbox(self) -> None:
        with self._lock:
            arrived, self._inbox = self._inbox, []
        (self._held if self.paused else self._waiting).extend(arrived)

    def _run_commands(self) -> bool:
        """Run due commands in order; returns True while a when_idle command still waits."""
        with self._lock:
            commands = list(self._commands)
        waiting_for_idle = False
        for command in commands:
            if command.when_idle and self._live() and self.paused is None:
                waiting_for_idle = True
                continue
            with self._lock:
                self._commands.remove(command)
            try:
                command.result.set_result(command.fn())
            except Exception as exc:  # reported to the caller, the loop goes on
                command.result.set_exception(exc)
        return waiting_for_idle

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as exc:  # a failed forward fails its requests, never the engine
            log.exception("engine step failed")
            for state in self._live():
                self._finish(state, {"type": "abort", "message": f"engine error: {exc!r}", "status_code": 500,
                                     "err_type": "InternalServerError"})
            self._set_batch(None, [])

    # ----- prefill -----------------------------------------------------------------------------------

    def _admit(self) -> bool:
        """Prefill as many waiting requests as the running limit and the token budget allow."""
        group: list[tuple[RequestState, list[int], int, list]] = []
        longest = 0
        for state in list(self._waiting):
            if len(self._live()) + len(group) >= self.max_running_requests:
                break
            tokens = state.tokens()
            cached, pieces = self.prefix_cache.match(tokens, len(tokens) - 1)
            if self.prefix_cache.enabled and any(
                    _shared_prefix(tokens, other) >= cached + IN_BATCH_PREFIX_MIN_TOKENS for _, other, _, _ in group):
                continue  # in-batch prefix caching: it will find that prefix cached after this prefill
            longest_if_added = max(longest, len(tokens) - cached)
            if group and longest_if_added * (len(group) + 1) > self.max_prefill_tokens:
                break
            self._waiting.remove(state)
            group.append((state, tokens, cached, pieces))
            longest = longest_if_added
        if not group:
            return False
        self._guarded_prefill(group)
        return True

    def _guarded_prefill(self, group) -> None:
        try:
            self._prefill(group)
        except Exception as exc:
            log.exception("prefill failed")
            for state, *_ in group:
                self._finish(state, {"type": "abort", "message": f"engine error: {exc!r}", "status_code": 500,
                                     "err_type": "InternalServerError"})

    def _prefill(self, group: list[tuple[RequestState, list[int], int, list]]) -> None:
        start = time.perf_counter()
        rows = len(group)
        cached_max = max(cached for _, _, cached, _ in group)
        suffix_max = max(len(tokens) - cached for _, tokens, cached, _ in group)
        device = self.kv_shape.device
        batch = BatchKV(self.kv_shape, rows, cached_max, capacity=cached_max + suffix_max)
        ids = torch.zeros(rows, suffix_max, dtype=torch.long)
        positions = torch.zeros(rows, suffix_max, dtype=torch.long)
        query_valid = torch.zeros(rows, suffix_max, dtype=torch.bool)
        for row, (state, tokens, cached, pieces) in enumerate(group):
            column = cached_max - cached
            for piece in pieces:
                batch.kv[:, :, row, :, column:column + piece.shape[3]] = piece
                column += piece.shape[3]
            batch.valid[row, cached_max - cached:cached_max] = True
            suffix = len(tokens) - cached
            ids[row, suffix_max - suffix:] = torch.tensor(tokens[cached:])
            positions[row, suffix_max - suffix:] = torch.arange(cached, len(tokens))
            query_valid[row, suffix_max - suffix:] = True
            state.cached_tokens = max(state.cached_tokens, min(cached, len(state.spec.input_ids)))
            if state.num_retractions == 0 or not state.output_ids:
                metrics.PROMPT_TOKENS.inc(len(state.spec.input_ids))
                metrics.CACHED_TOKENS.inc(cached)
        chunk = max(1, self.max_prefill_tokens // rows)
        for c0 in range(0, suffix_max, chunk):
            c1 = min(suffix_max, c0 + chunk)
            logits = forward_columns(self.model, batch, ids[:, c0:c1].to(device), positions[:, c0:c1].to(device),
                                     query_valid[:, c0:c1].to(device), fp32_lm_head=self.fp32_lm_head)
        generation = self.prefix_cache.generation
        for row, (state, tokens, cached, _) in enumerate(group):
            state.kv_generation, state.kv_inserted = generation, cached
            self._offer_to_prefix_cache(state, row, batch=batch, upto=len(tokens))
        metrics.PREFILL_SECONDS.observe(time.perf_counter() - start)
        states = [state for state, *_ in group]
        done = [row for row, s in enumerate(states) if s.spec.max_new_tokens <= len(s.output_ids)]
        for row in done:  # max_new_tokens == 0: prefill only (SGLang uses this to warm the cache)
            self._finish(states[row], {"type": "length", "length": states[row].spec.max_new_tokens})
        keep = [row for row in range(rows) if row not in done]
        if not keep:
            return
        if done:
            kept = batch.select(keep)
            batch.release()
            batch, states, logits = kept, [states[r] for r in keep], logits[keep]
        live_rows = [row for row, state in enumerate(self._running) if state is not None]
        if live_rows:  # finished rows are dropped by this copy
            merged = BatchKV.concat(self._batch, batch, first_rows=live_rows)
            batch.release()
            batch = merged
        self._set_batch(batch, [*self._live(), *states])
        self._sample_and_finish(logits, first_row=len(self._running) - len(states))

    # ----- decode ------------------------------------------------------------------------------------

    def _decode_step(self) -> None:
        start = time.perf_counter()
        device = self.kv_shape.device
        rows = self._running  # finished rows (None) ride along as padding until compaction
        ids = torch.tensor([[s.output_ids[-1] if s else 0] for s in rows], dtype=torch.long, device=device)
        positions = torch.tensor([[len(s.spec.input_ids) + len(s.output_ids) - 1 if s else 0] for s in rows],
                                 dtype=torch.long, device=device)
        valid = torch.tensor([[s is not None] for s in rows], dtype=torch.bool, device=device)
        logits = forward_columns(self.model, self._batch, ids, positions, valid, fp32_lm_head=self.fp32_lm_head)
        metrics.BATCH_SIZE.set(len(self._live()))
        self._sample_and_finish(logits, first_row=0)
        metrics.DECODE_STEP_SECONDS.observe(time.perf_counter() - start)

    def _sample_and_finish(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample one token for running rows [first_row, first_row + len(logits)), then retire finished rows."""
        rows = [first_row + i for i in range(logits.shape[0]) if self._running[first_row + i] is not None]
        states = [self._running[row] for row in rows]
        logits = logits[[row - first_row for row in rows]] if len(rows) < logits.shape[0] else logits
        tokens, logprobs = sample_next(logits, [s.spec.sampling for s in states], [s.generator for s in states])
        finished = []
        for row, state, token, logprob in zip(rows, states, tokens.tolist(), logprobs.tolist()):
            self._append(state, token, logprob)
            reason = self._stop_reason(state)
            if reason is not None:
                self._offer_to_prefix_cache(state, row)
                self._finish(state, reason)
                finished.append(row)
        metrics.GENERATION_TOKENS.inc(len(states))
        self._drop_rows(finished)

    def _append(self, state: RequestState, token: int, logprob: float) -> None:
        state.output_ids.append(token)
        state.logprobs.append(logprob)
        n = len(state.output_ids)
        if state.spans and state.spans[-1][0] == self.weight_version:
            state.spans[-1][2] = n
        else:
            state.spans.append([self.weight_version, n - 1, n])

    def _stop_reason(self, state: RequestState) -> dict | None:
        """SGLang 0.5.23's order (managers/schedule_batch.py:Req.update_finish_state): stop string or
        regex, then stop token or EOS (both off with ignore_eos), then length. So a stop on the last
        allowed token is "stop", not "length": the learner's overlong filter reads it as complete."""
        spec, token = state.spec, state.output_ids[-1]
        if spec.stop_strings or spec.stop_regex:
            tail = self.tokenizer.decode(state.output_ids[-state.stop_window_tokens:],
                                         skip_special_tokens=spec.skip_special_tokens)
            for stop in spec.stop_strings:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
            for pattern in spec.stop_regex:
                if re.search(pattern, tail):
                    return {"type": "stop", "matched": pattern}
        if not spec.ignore_eos and (token in spec.stop_token_ids or token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if len(state.output_ids) >= spec.max_new_tokens:
            return {"type": "length", "length": spec.max_new_tokens}
        return None

    # ----- bookkeeping -------------------------------------------------------------------------------

    def _live(self) -> list[RequestState]:
        return [state for state in self._running if state is not None]

    def _drop_rows(self, rows: list[int]) -> None:
        """Retire finished rows. Their KV stays as padding until enough rows are dead to repay the
        copy of compacting the batch (every live row's KV is copied), or the batch is empty."""
        for row in rows:
            self._running[row] = None
        live = [row for row, state in enumerate(self._running) if state is not None]
        dead = len(self._running) - len(live)
        if not live:
            self._set_batch(None, [])
            if not self._waiting:
                POOL.clear()  # idle: give the KV memory back
        elif dead and dead >= max(COMPACT_MIN_DEAD_ROWS, len(live)):
            self._set_batch(self._batch.select(live), [self._running[row] for row in live])

    def _set_batch(self, batch: BatchKV | None, running: list[RequestState | None]) -> None:
        """Replace the running batch; the old KV buffer goes back to the pool."""
        if self._batch is not None and self._batch is not batch:
            self._batch.release()
        self._batch, self._running = batch, running

    def _offer_to_prefix_cache(self, state: RequestState, row: int, batch: BatchKV | None = None,
                               upto: int | None = None) -> None:
        """Give the prefix cache the KV this row computed that it has not offered yet."""
        batch = batch or self._batch
        tokens = state.tokens()[:upto if upto is not None else len(state.tokens()) - 1]  # last token: no KV yet
        new = len(tokens) - state.kv_inserted
        if batch is None or new <= 0 or not self.prefix_cache.enabled:
            return
        self.prefix_cache.insert(tokens, batch.row_tail(row, new), state.kv_generation)
        state.kv_inserted = len(tokens)

    def _finish(self, state: RequestState, reason: dict) -> None:
        state.finish_reason = reason
        state.e2e_latency_s = time.monotonic() - state.created_s
        state.weight_version_at_end = self.weight_version
        with self._lock:
            self._rids.discard(state.spec.rid)
        kind = reason["type"]
        metrics.REQUESTS.labels(kind).inc()
        metrics.REQUEST_SECONDS.labels(kind).observe(state.e2e_latency_s)
        try:
            state.loop.call_soon_threadsafe(_resolve, state)
        except RuntimeError:  # the event loop is gone (shutdown): nobody waits for this answer
            pass


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _resolve(state: RequestState) -> None:
    if not state.future.done():
        state.future.set_result(state)
