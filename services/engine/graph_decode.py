"""The decode step over a static KV cache, replayed from CUDA graphs on a GPU (SGLang's
`--cuda-graph-max-bs`, `--disable-cuda-graph`).

Why: an eager decode step of a small model is launch-bound. SmolLM2-135M at batch 64 reads about
270 MB of bf16 weights per step (~0.06 ms of HBM time on an H200) but runs ~600 kernels through
transformers' Python; the eager step measured 43-45 ms there (BENCHMARKS.md, "The whole stack on
one GPU"). A CUDA graph replays the same kernels with one launch.

How (torch's own tools, `torch.cuda.CUDAGraph` with a shared memory pool):
* One static KV arena [layers, 2, max_rows, kv_heads, columns, head_dim] (`kv_batch.py`'s layout)
  and its validity [max_rows, columns]. The running batch lives in the arena: whenever the
  scheduler replaces it (a join or a compaction, far rarer than decode steps), its KV is copied in
  once (`adopt`; the arena view keeps `BatchKV`'s semantics, so prefill, joins, compaction and the
  prefix cache work unchanged).
* One graph per batch-size bucket (`batch_buckets`): a running batch of `rows` rows replays the
  smallest bucket >= rows; the extra rows are padding. The graph holds the whole step: the
  additive mask from the arena's validity and the step's column, the forward whose layers write
  their new K/V at that column (`index_copy_` at a device index, so every step replays the same
  graph), the last hidden state's logits in float32 (in float32 end to end with fp32_lm_head, as
  `forward_columns`), and the new column's validity.
* Inputs travel in one host-to-device copy per step (token ids, positions, row validity, column).

Correctness: the graph computes what `forward_columns` computes for one new column, attending to
the same keys; it only sees `columns` key slots instead of `length + 1`, the extra ones masked with
an additive minimum (exactly zero weight after the softmax). Log-probs match the eager step within
floating-point reordering (tests/unit/test_engine_graph_decode.py: the same static step run
eagerly on CPU, float32, against `forward_columns`, 1e-5; tests/gpu: graphs against eager, bf16).

Where graphs cannot run the scheduler decodes eagerly (`can_replay` False): on CPU, for a batch
with more rows than the largest bucket, or once a batch's shared time axis outgrows the arena
(`kv_batch.BatchKV.ensure_capacity` then moves it to a buffer of its own). Weights must stay in
the storages the graphs captured: the engine's `WeightStore` copies committed updates into them
(`copy_on_commit`) instead of re-pointing the parameters.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers.cache_utils import Cache, DynamicLayer

from services.engine.kv_batch import BatchKV, KVShape

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
WARMUP_STEPS = 2  # eager runs on a side stream before each capture (cuBLAS and SDPA pick kernels)


def batch_buckets(max_rows: int) -> list[int]:
    """Batch sizes to capture for at most `max_rows` rows: DEFAULT_BUCKETS up to it, and it."""
    return sorted({b for b in DEFAULT_BUCKETS if b < max_rows} | {max_rows})


class _ColumnLayer(DynamicLayer):
    """One layer of the static cache: writes the step's K/V at column `column` (a device tensor
    [1] int64) of the full-width buffers and attends over all of them (the mask hides the rest)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
        super().__init__()
        self._key_buffer, self._value_buffer, self._column = keys, values, column
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = keys, values

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._key_buffer.index_copy_(2, self._column, key_states)
        self._value_buffer.index_copy_(2, self._column, value_states)
        return self._key_buffer, self._value_buffer

    def get_seq_length(self) -> int:
        return self._key_buffer.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._key_buffer.shape[-2], 0


class GraphDecoder:
    """Static KV arena + one decode graph per batch bucket (see the module docstring).

    model: the engine's model (its parameters must not be re-pointed after `capture`).
    kv_shape: the model's KV geometry (`KVShape.of`). max_rows: rows of the arena and the largest
    bucket. columns: KV columns of the arena (positions on the batch's shared time axis).
    graphs: capture CUDA graphs (CUDA only); False runs the same static step eagerly (tests on CPU).
    Memory: the arena, 2 * layers * max_rows * kv_heads * columns * head_dim * dtype bytes, plus
    the graphs' shared pool (one step's activations at the largest bucket).
    """

    def __init__(
        self,
        model,
        kv_shape: KVShape,
        *,
        max_rows: int,
        columns: int,
        fp32_lm_head: bool,
        graphs: bool = True,
    ) -> None:
        if graphs and kv_shape.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {kv_shape.device}")
        self.model, self.kv_shape, self.fp32_lm_head = model, kv_shape, fp32_lm_head
        self.max_rows, self.columns, self.use_graphs = max_rows, columns, graphs
        device = kv_shape.device
        dims = (kv_shape.layers, 2, max_rows, kv_shape.kv_heads, columns, kv_shape.head_dim)
        self.kv = torch.zeros(dims, dtype=kv_shape.dtype, device=device)
        self.valid = torch.zeros(max_rows, columns, dtype=torch.bool, device=device)
        # one int64 host->device copy per step: ids [max_rows], positions [max_rows],
        # row validity [max_rows], column [1]
        self._inputs = torch.zeros(3 * max_rows + 1, dtype=torch.long, device=device)
        self._host = torch.zeros(
            3 * max_rows + 1, dtype=torch.long, pin_memory=device.type == "cuda"
        )
        self._column_range = torch.arange(columns, device=device)
        self.buckets = batch_buckets(max_rows)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0

    @property
    def bytes(self) -> int:
        """Bytes of the arena and its validity."""
        return self.kv.numel() * self.kv.element_size() + self.valid.numel()

    # ----- the running batch in the arena ----------------------------------------------------------

    def adopt(self, batch: BatchKV) -> bool:
        """Move `batch` into the arena (one copy of its used columns) unless it is there already or
        does not fit (more rows than the arena, or no free column for the next step). Returns
        whether `batch` is now arena-backed."""
        if batch.kv is not None and batch.kv.data_ptr() == self.kv.data_ptr():
            return True
        rows, length = batch.rows, batch.length
        if rows > self.max_rows or length + 1 > self.columns:
            return False
        arena = self.kv[:, :, :rows]
        arena[..., :length, :].copy_(batch.kv[:, :, :, :, :length])
        self.valid[:rows, :length] = batch.valid[:, :length]
        self.valid[:rows, length:] = False
        batch.move_to(arena, self.valid[:rows])
        return True

    def can_replay(self, batch: BatchKV) -> bool:
        """Whether `batch`'s next decode step can run here (arena-backed, a free column)."""
        return (
            batch.kv is not None
            and batch.kv.data_ptr() == self.kv.data_ptr()
            and batch.length < self.columns
        )

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    # ----- the step ----------------------------------------------------------------------------------

    def _views(self, bucket: int):
        n = self.max_rows
        ids = self._inputs[:bucket].view(bucket, 1)
        positions = self._inputs[n : n + bucket].view(bucket, 1)
        row_valid = self._inputs[2 * n : 2 * n + bucket].bool()
        column = self._inputs[3 * n :]
        return ids, positions, row_valid, column

    def _step(self, bucket: int) -> torch.Tensor:
        """One static decode step for the arena's first `bucket` rows; logits [bucket, V] float32.
        Only device work at fixed shapes: what a graph captures."""
        ids, positions, row_valid, column = self._views(bucket)
        kv, valid = self.kv[:, :, :bucket], self.valid[:bucket]
        allowed = valid | (self._column_range == column)[None, :]  # the new column: every row
        mask = torch.zeros(bucket, 1, 1, self.columns, dtype=self.kv_shape.dtype, device=kv.device)
        mask.masked_fill_(~allowed[:, None, None, :], torch.finfo(self.kv_shape.dtype).min)
        cache = Cache(
            layers=[_ColumnLayer(kv[i, 0], kv[i, 1], column) for i in range(self.kv_shape.layers)]
        )
        hidden = self.model.get_decoder()(
            input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True
        ).last_hidden_state[:, -1, :]
        head = self.model.get_output_embeddings()
        if self.fp32_lm_head:
            logits = torch.nn.functional.linear(
                hidden.float(),
                head.weight.float(),
                None if head.bias is None else head.bias.float(),
            )
        else:
            logits = head(hidden).float()
        valid.index_copy_(1, column, row_valid[:, None])
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, in one shared memory pool (no-op without
        graphs). Runs each bucket's step WARMUP_STEPS times on a side stream first. Writes only
        padding into the arena: call before any batch is adopted."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self._inputs.zero_()
        side = torch.cuda.Stream(self.kv.device)
        side.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(side):
            for bucket in reversed(self.buckets):
                for _ in range(WARMUP_STEPS):
                    self._step(bucket)
        torch.cuda.current_stream(self.kv.device).wait_stream(side)
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._step(bucket)
            self._graphs[bucket] = (graph, logits)
        torch.cuda.synchronize(self.kv.device)
        self.valid.zero_()
        self.capture_s = time.perf_counter() - start
        log.info(
            "decode graphs captured",
            extra={
                "buckets": self.buckets,
                "kv_columns": self.columns,
                "arena_bytes": self.bytes,
                "seconds": round(self.capture_s, 2),
            },
        )

    @torch.inference_mode()
    def decode(
        self, batch: BatchKV, ids: list[int], positions: list[int], row_valid: list[bool]
    ) -> torch.Tensor:
        """The next column of arena-backed `batch` (`can_replay`): one token per row (ids,
        positions: the rows' last tokens and their positions; row_valid False for finished rows).
        Returns logits [rows, V] float32 (a view valid until the next step) and advances
        `batch.length`."""
        rows, n = len(ids), self.max_rows
        bucket = self.bucket(rows)
        host = self._host
        host.zero_()
        host[:rows] = torch.tensor(ids, dtype=torch.long)
        host[n : n + rows] = torch.tensor(positions, dtype=torch.long)
        host[2 * n : 2 * n + rows] = torch.tensor(row_valid, dtype=torch.long)
        host[3 * n] = batch.length
        self._inputs.copy_(host, non_blocking=True)
        if self.use_graphs:
            graph, logits = self._graphs[bucket]
            graph.replay()
        else:
            logits = self._step(bucket)
        batch.length += 1
        return logits[:rows]
