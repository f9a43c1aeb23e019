"""KV cache of the running batch, and the two forward passes over it (prefill and decode).

Layout: one tensor `kv` of shape [layers, 2, B, kv_heads, capacity, head_dim] (keys at [:, 0],
values at [:, 1]); the first `length` columns are in use. Column = position on the batch's shared
time axis; `valid[b, c]` says whether row b has a real token in column c. Every row's newest token
is in column `length - 1` (rows are right-aligned), so one decode step appends one column for
all rows. Holes (padding) can sit anywhere in a row: at the left of a short row, and between a
row's cached prefix and its prompt suffix after a prefill.

Correctness (pitfall C09: logprobs must not depend on padding or batch company): every forward
gets explicit `position_ids` (the row's real token positions) and a 4D additive mask built here:
query token q of row b attends to key column c iff `valid[b, c]` and c <= q's column, and every
padding query attends to itself only, so no row is ever fully masked and no NaN can appear.
Padded columns hold finite values that get exactly zero attention weight.

The model sees the buffer through `SlotCache`, a transformers `Cache` whose layers write new K/V
into preallocated columns instead of concatenating (no O(length) copy per decode step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

HEADROOM_COLUMNS = 128
POOL_BLOCKS = 2  # freed KV buffers kept for reuse (see BufferPool): a ping-pong pair
POOL_MAX_BYTES = 1 << 30  # ... holding at most this much memory together


class BufferPool:
    """Freed KV buffers, reused by the next batch that fits (best fit, zeroed on reuse).

    A fresh multi-hundred-MB allocation costs a page fault per 4 KiB, several times the copy that
    fills it on a small VM; batches are rebuilt on every join and compaction, so buffers recycle.
    """

    def __init__(self, max_blocks: int = POOL_BLOCKS, max_bytes: int = POOL_MAX_BYTES) -> None:
        self.max_blocks, self.max_bytes = max_blocks, max_bytes
        self._free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D block of at least `numel` elements whose first `numel` are zero (an inference tensor:
        KV buffers are only ever used under `torch.inference_mode()`)."""
        with torch.inference_mode():
            return self._take(numel, dtype, device)

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        fits = [
            b for b in self._free if b.numel() >= numel and b.dtype == dtype and b.device == device
        ]
        if not fits:
            return torch.zeros(numel, dtype=dtype, device=device)
        block = min(fits, key=lambda b: b.numel())
        self._free = [
            b for b in self._free if b is not block
        ]  # by identity: == on tensors is elementwise
        block[:numel].zero_()
        return block

    def give(self, block: torch.Tensor) -> None:
        """Return a buffer nothing else references any more. The most recently freed blocks are kept,
        within `max_blocks` and `max_bytes`; the others go back to the allocator."""
        kept, total = [], 0
        for candidate in [block, *self._free]:
            size = candidate.numel() * candidate.element_size()
            if len(kept) < self.max_blocks and total + size <= self.max_bytes:
                kept.append(candidate)
                total += size
        self._free = kept

    def clear(self) -> None:
        """Drop every kept block (an idle engine holds no KV memory)."""
        self._free = []

    @property
    def bytes(self) -> int:
        """Bytes of the kept blocks."""
        return sum(b.numel() * b.element_size() for b in self._free)


POOL = BufferPool()


class _SlotLayer(DynamicLayer):
    """One layer of `SlotCache`: appends into columns [length, length + q) of preallocated buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self._key_buffer, self._value_buffer, self.length = keys, values, length
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self._key_buffer[:, :, self.length : end].copy_(key_states)
        self._value_buffer[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0


@dataclass(frozen=True)
class KVShape:
    """Per-token KV geometry of a model: layers, kv_heads, head_dim; dtype and device of the cache."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(model) -> KVShape:
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        param = next(model.parameters())
        return KVShape(
            config.num_hidden_layers,
            getattr(config, "num_key_value_heads", None) or heads,
            head_dim,
            param.dtype,
            param.device,
        )

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class BatchKV:
    """KV and validity of B right-aligned rows; see the module docstring for the layout."""

    def __init__(self, shape: KVShape, rows: int, length: int, capacity: int | None = None) -> None:
        capacity = max(capacity or 0, length + HEADROOM_COLUMNS)
        self.shape, self.length = shape, length
        dims = (shape.layers, 2, rows, shape.kv_heads, capacity, shape.head_dim)
        self._block = POOL.take(math.prod(dims), shape.dtype, shape.device)
        self.kv = self._block[: math.prod(dims)].view(dims)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=shape.device)

    def release(self) -> None:
        """Give the KV buffer back to the pool; this BatchKV must not be used afterwards. A batch
        that lives in a `GraphDecoder`'s arena (`move_to`) owns no buffer: nothing is freed."""
        if self._block is not None:
            POOL.give(self._block)
            self._block = self.kv = None

    def move_to(self, kv: torch.Tensor, valid: torch.Tensor) -> None:
        """Live in `kv` [layers, 2, rows, kv_heads, capacity, head_dim] and `valid` [rows, capacity]
        from now on (views of a `graph_decode.GraphDecoder` arena, already holding this batch's
        columns); the own buffer goes back to the pool. Growth (`ensure_capacity`) moves it out."""
        own = self._block
        self.kv, self.valid, self._block = kv, valid, None
        if own is not None:
            POOL.give(own)

    @property
    def bytes(self) -> int:
        """Bytes of the KV buffer (its pool block, which may be larger than the batch needs)."""
        return 0 if self._block is None else self._block.numel() * self._block.element_size()

    @property
    def rows(self) -> int:
        return self.kv.shape[2]

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def ensure_capacity(self, extra_columns: int) -> None:
        """Room for `extra_columns` more columns (grows by copying into a larger buffer)."""
        if self.length + extra_columns <= self.capacity:
            return
        grown = BatchKV(
            self.shape, self.rows, self.length, self.length + extra_columns + self.capacity // 2
        )
        grown.kv[:, :, :, :, : self.length] = self.kv[:, :, :, :, : self.length]
        grown.valid[:, : self.length] = self.valid[:, : self.length]
        self.release()
        self.kv, self.valid, self._block = grown.kv, grown.valid, grown._block

    def cache(self) -> Cache:
        """A transformers Cache view over the buffer at the current length."""
        return Cache(
            layers=[
                _SlotLayer(self.kv[i, 0], self.kv[i, 1], self.length)
                for i in range(self.shape.layers)
            ]
        )

    def select(self, rows: list[int]) -> BatchKV:
        """A new BatchKV with only `rows` (in that order), leading all-padding columns dropped."""
        index = torch.tensor(rows, dtype=torch.long, device=self.kv.device)
        valid = self.valid[index, : self.length]
        used = valid.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.length
        out = BatchKV(self.shape, len(rows), self.length - start)
        out.kv[:, :, :, :, : out.length] = self.kv[:, :, index, :, start : self.length]
        out.valid[:, : out.length] = valid[:, start:]
        return out

    @staticmethod
    def concat(first: BatchKV, second: BatchKV, first_rows: list[int] | None = None) -> BatchKV:
        """Rows `first_rows` of `first` (default all), then all rows of `second`, right-aligned to the
        longer of the two."""
        selected = first_rows is not None and first_rows != list(range(first.rows))
        if selected:
            first = first.select(first_rows)
        length = max(first.length, second.length)
        out = BatchKV(first.shape, first.rows + second.rows, length)
        for part, row0 in ((first, 0), (second, first.rows)):
            rows, col0 = slice(row0, row0 + part.rows), length - part.length
            out.kv[:, :, rows, :, col0:length] = part.kv[:, :, :, :, : part.length]
            out.valid[rows, col0:length] = part.valid[:, : part.length]
        if selected:
            first.release()  # our temporary; the caller owns the originals
        return out

    def row_tail(self, row: int, tokens: int) -> torch.Tensor:
        """KV of the last `tokens` real tokens of `row`: [layers, 2, kv_heads, tokens, head_dim] (a copy)."""
        columns = self.valid[row, : self.length].nonzero().squeeze(1)[-tokens:] if tokens else None
        if columns is None:
            return self.kv.new_zeros(
                self.shape.layers, 2, self.shape.kv_heads, 0, self.shape.head_dim
            )
        return self.kv[:, :, row].index_select(3, columns)

    def attention_mask(self, query_valid: torch.Tensor) -> torch.Tensor:
        """Additive mask [B, 1, q, length + q] for `q` new columns with validity `query_valid` [B, q]."""
        rows, q = query_valid.shape
        keys_valid = torch.cat(
            [self.valid[:, : self.length], query_valid], dim=1
        )  # [B, length + q]
        query_columns = torch.arange(self.length, self.length + q, device=keys_valid.device)
        key_columns = torch.arange(self.length + q, device=keys_valid.device)
        causal = key_columns[None, :] <= query_columns[:, None]  # [q, length + q]
        allowed = keys_valid[:, None, :] & causal[None]
        own = key_columns[None, :] == query_columns[:, None]
        allowed = allowed | (
            own[None] & ~query_valid[:, :, None]
        )  # padding queries see themselves only
        mask = torch.zeros(
            rows, 1, q, self.length + q, dtype=self.shape.dtype, device=keys_valid.device
        )
        return mask.masked_fill_(~allowed[:, None], torch.finfo(self.shape.dtype).min)


@torch.inference_mode()
def forward_columns(
    model,
    batch: BatchKV,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_valid: torch.Tensor,
    *,
    fp32_lm_head: bool = False,
) -> torch.Tensor:
    """Run `q` new columns for every row and append their K/V; returns last-column logits [B, V] float32.

    input_ids, positions: [B, q] int64 (positions are each token's real position in its sequence);
    query_valid: [B, q] bool, False for padding. The last column must be a real token for every row.
    fp32_lm_head: the LM head runs as `linear(hidden.float(), weight.float())`, the learner's
    computation (shellrl.rl.logprobs.head_logprobs), instead of in the model's dtype (bf16 logits
    round by up to 2^-8 relative: ~0.06 at a logit of 16).
    """
    q = input_ids.shape[1]
    batch.ensure_capacity(q)
    mask = batch.attention_mask(query_valid)
    if fp32_lm_head:
        hidden = model.get_decoder()(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            cache=batch.cache(),
            use_cache=True,
        ).last_hidden_state[:, -1, :]
        head = model.get_output_embeddings()
        logits = torch.nn.functional.linear(
            hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float()
        )
    else:
        out = model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            cache=batch.cache(),
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()
    batch.valid[:, batch.length : batch.length + q] = query_valid
    batch.length += q
    return logits
