"""The running batch: the requests being decoded together, one row each of one KV buffer.

Used by the scheduler thread only (not thread-safe). Runs the forward passes: the batched,
chunked prefill of newly admitted requests (with their prefix-cache hits as KV) and the decode
step of every running row. Finished rows stay as padding until enough of them pile up to repay
compacting; every computed KV is offered to the prefix cache. Deciding when a request stops is the
scheduler's.
"""

from __future__ import annotations

import torch

from services.engine import metrics
from services.engine.admission import Admitted
from services.engine.graph_decode import GraphDecoder
from services.engine.kv_batch import BatchKV, KVShape, forward_columns
from services.engine.prefix_cache import PrefixCache
from services.engine.request_state import RequestState
from services.engine.sampling import sample_next

# Finished rows stay in the batch as padding (a few wasted rows per step) until this many, or as
# many as the live rows, have piled up; compacting copies every live row's KV.
COMPACT_MIN_DEAD_ROWS = 8


class RunningBatch:
    """Rows (`None` = finished, awaiting compaction) and their KV (see the module docstring)."""

    def __init__(
        self,
        model,
        kv_shape: KVShape,
        prefix_cache: PrefixCache,
        *,
        max_prefill_tokens: int,
        fp32_lm_head: bool,
        graph: GraphDecoder | None = None,
    ) -> None:
        self.model, self.kv_shape, self.prefix_cache = model, kv_shape, prefix_cache
        self.max_prefill_tokens, self.fp32_lm_head = max_prefill_tokens, fp32_lm_head
        self.graph = graph  # decode steps replayed over its static arena where they fit
        self.rows: list[RequestState | None] = []  # None = finished, awaiting compaction
        self.kv: BatchKV | None = None

    def live(self) -> list[RequestState]:
        return [state for state in self.rows if state is not None]

    @property
    def bytes(self) -> int:
        return self.kv.bytes if self.kv is not None else 0

    def replace(self, kv: BatchKV | None, rows: list[RequestState | None]) -> None:
        """Replace the running batch; the old KV buffer goes back to the pool."""
        if self.kv is not None and self.kv is not kv:
            self.kv.release()
        self.kv, self.rows = kv, rows
        if self.graph is not None and kv is not None:
            self.graph.adopt(kv)  # one copy into the static arena, unless it does not fit

    def clear(self) -> None:
        self.replace(None, [])

    def retire(self, rows: list[int]) -> None:
        """Retire finished rows. Their KV stays as padding until enough rows are dead to repay the
        copy of compacting the batch (every live row's KV is copied), or the batch is empty."""
        for row in rows:
            self.rows[row] = None
        live = [row for row, state in enumerate(self.rows) if state is not None]
        dead = len(self.rows) - len(live)
        if not live:
            self.clear()
        elif dead and dead >= max(COMPACT_MIN_DEAD_ROWS, len(live)):
            self.replace(self.kv.select(live), [self.rows[row] for row in live])

    def join(self, kv: BatchKV, states: list[RequestState]) -> int:
        """Add prefilled rows (`kv`, one row per state) after the live rows; returns the first new
        row. Finished rows are dropped by this copy."""
        live_rows = [row for row, state in enumerate(self.rows) if state is not None]
        if live_rows:
            merged = BatchKV.concat(self.kv, kv, first_rows=live_rows)
            kv.release()
            kv = merged
        self.replace(kv, [*self.live(), *states])
        return len(self.rows) - len(states)

    def offer_to_prefix_cache(
        self, state: RequestState, row: int, kv: BatchKV | None = None, upto: int | None = None
    ) -> None:
        """Give the prefix cache the KV this row computed that it has not offered yet."""
        kv = kv or self.kv
        tokens = state.tokens()[
            : upto if upto is not None else len(state.tokens()) - 1
        ]  # last token: no KV yet
        new = len(tokens) - state.kv_inserted
        if kv is None or new <= 0 or not self.prefix_cache.enabled:
            return
        self.prefix_cache.insert(tokens, kv.row_tail(row, new), state.kv_generation)
        state.kv_inserted = len(tokens)

    # ----- forward passes and sampling ------------------------------------------------------------

    def prefill(self, group: list[Admitted]) -> tuple[BatchKV, torch.Tensor]:
        """Prefill `group` into a new KV buffer, one row each: prompt suffixes after the cached
        prefix, right-aligned, in forwards of at most `max_prefill_tokens` padded tokens. Returns
        the KV (offered to the prefix cache) and the last column's logits, [rows, vocab] float32."""
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
                batch.kv[:, :, row, :, column : column + piece.shape[3]] = piece
                column += piece.shape[3]
            batch.valid[row, cached_max - cached : cached_max] = True
            suffix = len(tokens) - cached
            ids[row, suffix_max - suffix :] = torch.tensor(tokens[cached:])
            positions[row, suffix_max - suffix :] = torch.arange(cached, len(tokens))
            query_valid[row, suffix_max - suffix :] = True
            state.cached_tokens = max(state.cached_tokens, min(cached, len(state.spec.input_ids)))
            if state.num_retractions == 0 or not state.output_ids:
                metrics.PROMPT_TOKENS.inc(len(state.spec.input_ids))
                metrics.CACHED_TOKENS.inc(cached)
        chunk = max(1, self.max_prefill_tokens // rows)
        for c0 in range(0, suffix_max, chunk):
            c1 = min(suffix_max, c0 + chunk)
            logits = forward_columns(
                self.model,
                batch,
                ids[:, c0:c1].to(device),
                positions[:, c0:c1].to(device),
                query_valid[:, c0:c1].to(device),
                fp32_lm_head=self.fp32_lm_head,
            )
        generation = self.prefix_cache.generation
        for row, (state, tokens, cached, _) in enumerate(group):
            state.kv_generation, state.kv_inserted = generation, cached
            self.offer_to_prefix_cache(state, row, kv=batch, upto=len(tokens))
        return batch, logits

    def decode(self) -> torch.Tensor:
        """One forward of every row's last token; [rows, vocab] float32 logits
        (finished rows: padding)."""
        device = self.kv_shape.device
        rows = self.rows  # finished rows (None) ride along as padding until compaction
        graph = self.graph
        if graph is not None and len(rows) <= graph.max_rows and graph.can_replay(self.kv):
            metrics.DECODE_STEPS.labels("graph" if graph.use_graphs else "static").inc()
            return graph.decode(
                self.kv,
                [s.output_ids[-1] if s else 0 for s in rows],
                [len(s.spec.input_ids) + len(s.output_ids) - 1 if s else 0 for s in rows],
                [s is not None for s in rows],
            )
        metrics.DECODE_STEPS.labels("eager").inc()
        ids = torch.tensor(
            [[s.output_ids[-1] if s else 0] for s in rows], dtype=torch.long, device=device
        )
        positions = torch.tensor(
            [[len(s.spec.input_ids) + len(s.output_ids) - 1 if s else 0] for s in rows],
            dtype=torch.long,
            device=device,
        )
        valid = torch.tensor([[s is not None] for s in rows], dtype=torch.bool, device=device)
        return forward_columns(
            self.model, self.kv, ids, positions, valid, fp32_lm_head=self.fp32_lm_head
        )

    def sample(
        self, logits: torch.Tensor, first_row: int
    ) -> list[tuple[int, RequestState, int, float]]:
        """One token for each live row in [first_row, first_row + len(logits)) from `logits`
        [len, vocab] float32: [(row, state, token id, its log-prob)], in row order."""
        rows = [
            first_row + i for i in range(logits.shape[0]) if self.rows[first_row + i] is not None
        ]
        states = [self.rows[row] for row in rows]
        logits = (
            logits[[row - first_row for row in rows]] if len(rows) < logits.shape[0] else logits
        )
        tokens, logprobs = sample_next(
            logits, [s.spec.sampling for s in states], [s.generator for s in states]
        )
        return list(zip(rows, states, tokens.tolist(), logprobs.tolist()))
