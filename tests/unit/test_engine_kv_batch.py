"""Pitfall C09 at the source: a row's logits do not depend on padding, holes or batch company."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv_batch import BatchKV, KVShape, forward_columns
from shellrl.models import load_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny", dtype=torch.float32)


def reference_last_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)


@torch.inference_mode()  # as on the engine's scheduler thread
def test_rows_with_cached_prefixes_holes_and_padding_match_unpadded_forwards(model):
    shape = KVShape.of(model)
    sequences = [list(range(100, 130)), list(range(200, 207)), list(range(300, 345))]
    cached = [20, 0, 5]  # prefix tokens whose KV comes from an earlier, separate forward
    prefix_kv = []
    for seq, n in zip(sequences, cached):
        single = BatchKV(shape, 1, 0)
        if n:
            forward_columns(
                model,
                single,
                torch.tensor([seq[:n]]),
                torch.arange(n)[None],
                torch.ones(1, n, dtype=torch.bool),
            )
        prefix_kv.append(single.row_tail(0, n))
    rows, prefix_max = len(sequences), max(cached)
    suffix_max = max(len(s) - n for s, n in zip(sequences, cached))
    batch = BatchKV(shape, rows, prefix_max)
    ids = torch.zeros(rows, suffix_max, dtype=torch.long)
    positions = torch.zeros(rows, suffix_max, dtype=torch.long)
    valid = torch.zeros(rows, suffix_max, dtype=torch.bool)
    for row, (seq, n) in enumerate(zip(sequences, cached)):
        batch.kv[:, :, row, :, prefix_max - n : prefix_max] = prefix_kv[row]
        batch.valid[row, prefix_max - n : prefix_max] = True
        suffix = len(seq) - n
        ids[row, suffix_max - suffix :] = torch.tensor(seq[n:])
        positions[row, suffix_max - suffix :] = torch.arange(n, len(seq))
        valid[row, suffix_max - suffix :] = True
    for start in range(0, suffix_max, 16):  # chunked prefill, as the scheduler does
        logits = forward_columns(
            model,
            batch,
            ids[:, start : start + 16],
            positions[:, start : start + 16],
            valid[:, start : start + 16],
        )
    for row, seq in enumerate(sequences):
        got = torch.log_softmax(logits[row], -1)
        assert (got - reference_last_logprobs(model, seq)).abs().max() <= 1e-5
    # one decode step for everyone, then drop the middle row and decode again
    nxt = [7, 8, 9]
    logits = forward_columns(
        model,
        batch,
        torch.tensor([[t] for t in nxt]),
        torch.tensor([[len(s)] for s in sequences]),
        torch.ones(rows, 1, dtype=torch.bool),
    )
    for row, seq in enumerate(sequences):
        assert (
            torch.log_softmax(logits[row], -1) - reference_last_logprobs(model, seq + [nxt[row]])
        ).abs().max() <= 1e-5
    kept = batch.select([0, 2])
    logits = forward_columns(
        model,
        kept,
        torch.tensor([[11], [12]]),
        torch.tensor([[len(sequences[0]) + 1], [len(sequences[2]) + 1]]),
        torch.ones(2, 1, dtype=torch.bool),
    )
    for out_row, (seq, first, second) in enumerate(((sequences[0], 7, 11), (sequences[2], 9, 12))):
        expected = reference_last_logprobs(model, seq + [first, second])
        assert (torch.log_softmax(logits[out_row], -1) - expected).abs().max() <= 1e-5


@torch.inference_mode()  # pooled blocks are inference tensors, as on the scheduler thread
def test_buffer_pool_reuses_a_freed_block_within_its_byte_budget():
    from services.engine.kv_batch import BufferPool

    pool = BufferPool(max_blocks=2, max_bytes=4096)
    block = pool.take(100, torch.float32, torch.device("cpu"))
    block.fill_(7.0)
    pool.give(block)
    again = pool.take(50, torch.float32, torch.device("cpu"))
    assert again is block and again[:50].eq(0).all(), "reused, and zeroed where it will be used"
    pool.give(torch.zeros(2000))  # 8000 bytes: over the budget, not kept
    assert pool.take(10, torch.float32, torch.device("cpu")) is not block
    pool.give(block)
    pool.clear()
    assert pool.take(10, torch.float32, torch.device("cpu")) is not block
