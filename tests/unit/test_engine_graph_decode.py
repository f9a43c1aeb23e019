"""The static decode step of services/engine/graph_decode.py (what the CUDA graphs capture), run
eagerly on CPU against transformers' forward over the batch's own KV (`forward_columns`).

float32, so the two paths differ only by the reordering of masked sums: tolerance 1e-5 on
log-probs. tests/gpu/test_gpu_engine_graphs.py checks the captured graphs on a GPU in bfloat16.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine import metrics
from services.engine.graph_decode import GraphDecoder, batch_buckets
from services.engine.kv_batch import BatchKV, KVShape, forward_columns
from services.engine.prefix_cache import PrefixCache
from services.engine.protocol import RequestSpec
from services.engine.sampling import SamplingSpec, _truncated_probs, _truncated_probs_rows
from services.engine.scheduler import Scheduler
from services.engine.weights import StagedWeights, WeightStore
from shellrl.models import load_model, load_tokenizer

TOLERANCE = 1e-5  # float32 log-probs of the same computation, masked keys added or not


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny", dtype=torch.float32)


def prefilled(model, sequences: list[list[int]]) -> BatchKV:
    """A right-aligned batch of `sequences` (one prefill forward, padding on the left)."""
    shape = KVShape.of(model)
    rows, longest = len(sequences), max(len(s) for s in sequences)
    batch = BatchKV(shape, rows, 0, capacity=longest)
    ids = torch.zeros(rows, longest, dtype=torch.long)
    positions = torch.zeros(rows, longest, dtype=torch.long)
    valid = torch.zeros(rows, longest, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, longest - len(seq) :] = torch.tensor(seq)
        positions[row, longest - len(seq) :] = torch.arange(len(seq))
        valid[row, longest - len(seq) :] = True
    forward_columns(model, batch, ids, positions, valid)
    return batch


def twin(batch: BatchKV) -> BatchKV:
    """A copy of `batch` in a buffer of its own."""
    return batch.select(list(range(batch.rows)))


def step_inputs(tokens: list[int | None], lengths: list[int]):
    ids = [t if t is not None else 0 for t in tokens]
    positions = [n - 1 if t is not None else 0 for t, n in zip(tokens, lengths)]
    return ids, positions, [t is not None for t in tokens]


@torch.inference_mode()
def test_static_steps_match_the_eager_forward_through_holes_padding_rows_and_compaction(model):
    sequences = [list(range(100, 130)), list(range(200, 207)), list(range(300, 345))]
    graph = GraphDecoder(
        model, KVShape.of(model), max_rows=8, columns=96, fp32_lm_head=False, graphs=False
    )
    static = prefilled(model, sequences)
    eager = twin(static)
    assert graph.adopt(static) and graph.can_replay(static)
    assert static.kv.data_ptr() == graph.kv.data_ptr()
    lengths = [len(s) for s in sequences]
    tokens: list[int | None] = [7, 8, 9]
    for step in range(12):
        if step == 5:  # row 1 finishes: it rides along as padding (valid False)
            tokens[1] = None
        lengths = [n + (t is not None) for n, t in zip(lengths, tokens)]
        ids, positions, row_valid = step_inputs(tokens, lengths)
        got = graph.decode(static, ids, positions, row_valid)
        want = forward_columns(
            model,
            eager,
            torch.tensor(ids)[:, None],
            torch.tensor(positions)[:, None],
            torch.tensor(row_valid)[:, None],
        )
        live = [r for r, t in enumerate(tokens) if t is not None]
        torch.testing.assert_close(
            torch.log_softmax(got[live], -1),
            torch.log_softmax(want[live], -1),
            atol=TOLERANCE,
            rtol=0,
        )
        assert static.length == eager.length
        assert torch.equal(static.valid[:, : static.length], eager.valid[:, : eager.length])
        tokens = [int(got[r].argmax()) if t is not None else None for r, t in enumerate(tokens)]
    # compaction: the live rows, selected into a buffer of their own, then adopted again
    live = [r for r, t in enumerate(tokens) if t is not None]
    compacted = static.select(live)
    eager_compacted = eager.select(live)
    assert graph.adopt(compacted)
    tokens, lengths = [tokens[r] for r in live], [lengths[r] for r in live]
    lengths = [n + 1 for n in lengths]
    ids, positions, row_valid = step_inputs(tokens, lengths)
    got = graph.decode(compacted, ids, positions, row_valid)
    want = forward_columns(
        model,
        eager_compacted,
        torch.tensor(ids)[:, None],
        torch.tensor(positions)[:, None],
        torch.tensor(row_valid)[:, None],
    )
    torch.testing.assert_close(
        torch.log_softmax(got, -1), torch.log_softmax(want, -1), atol=TOLERANCE, rtol=0
    )


@torch.inference_mode()
def test_a_batch_that_outgrows_the_arena_moves_out_and_decodes_eagerly(model):
    graph = GraphDecoder(
        model, KVShape.of(model), max_rows=4, columns=20, fp32_lm_head=False, graphs=False
    )
    batch = prefilled(model, [list(range(50, 68))])  # 18 columns: two steps fit, the third not
    assert graph.adopt(batch)
    for _ in range(2):
        assert graph.can_replay(batch)
        graph.decode(batch, [3], [batch.length], [True])
    assert batch.length == 20 and not graph.can_replay(batch)
    forward_columns(model, batch, torch.tensor([[4]]), torch.tensor([[20]]), torch.tensor([[True]]))
    assert batch.kv.data_ptr() != graph.kv.data_ptr() and batch.capacity > 20
    assert not graph.adopt(prefilled(model, [list(range(30))]))  # 30 + 1 columns > 20
    assert not graph.adopt(prefilled(model, [[1, 2]] * 5))  # 5 rows > 4


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert batch_buckets(64) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    graph = GraphDecoder.__new__(GraphDecoder)
    graph.buckets = batch_buckets(64)
    assert [graph.bucket(n) for n in (1, 3, 13, 33, 64)] == [1, 4, 16, 40, 64]


def test_copy_on_commit_writes_into_the_parameters_own_storage(model):
    store = WeightStore(model, copy_on_commit=True)
    name, param = next(iter(model.named_parameters()))
    address, before = param.data_ptr(), param.detach().clone()
    for round_ in range(2):  # a second update stages into the same arena again
        staged: StagedWeights = store.stage([(name, before + round_ + 1)])
        store.commit(staged)
        assert param.data_ptr() == address
        assert torch.equal(param.detach(), before + round_ + 1)
    store.commit(store.stage([(name, before)]))


def test_rows_truncated_together_equal_each_row_truncated_alone():
    logprobs = torch.log_softmax(torch.randn(5, 40, generator=torch.Generator().manual_seed(3)), -1)
    specs = [
        SamplingSpec(0.7),
        SamplingSpec(1.0, top_k=3),
        SamplingSpec(1.0, top_p=0.5),
        SamplingSpec(1.0, top_k=10, top_p=0.8, min_p=0.05),
        SamplingSpec(1.0, min_p=0.2),
    ]
    together = _truncated_probs_rows(logprobs, specs)
    for row, spec in enumerate(specs):
        torch.testing.assert_close(together[row], _truncated_probs(logprobs[row], spec))


async def _generate_all(scheduler: Scheduler, waves: list[list[RequestSpec]]) -> dict:
    """Submit wave 0, then each next wave once the previous wave's first request finished (they
    join a running batch); returns rid -> (output_ids, logprobs)."""
    loop = asyncio.get_running_loop()
    scheduler.start()
    try:
        states = []
        for wave in waves:
            submitted = scheduler.submit_many(wave, loop)
            states += submitted
            await asyncio.wait_for(submitted[0].future, 120)
        await asyncio.wait_for(asyncio.gather(*(s.future for s in states)), 120)
    finally:
        scheduler.stop()
    return {s.spec.rid: (s.output_ids, s.logprobs) for s in states}


def test_a_scheduler_decoding_in_the_arena_generates_what_the_eager_one_does(model):
    """Joins, finished rows riding as padding, compaction and prefix-cache hits, through the
    static step (graphs=False on CPU: the path the graphs replay) and through the eager one."""
    tokenizer = load_tokenizer("tiny")
    shared = list(range(400, 440))

    def spec(rid: str, n: int, new: int) -> RequestSpec:
        return RequestSpec(
            rid=rid,
            input_ids=tuple(shared[: 10 + n] + list(range(600 + n, 620 + 2 * n))),
            max_new_tokens=new,
            sampling=SamplingSpec(0.0),
            ignore_eos=True,
        )

    waves = [
        [spec(f"a{i}", i, 4 + 3 * i) for i in range(6)],
        [spec(f"b{i}", 2 * i, 12) for i in range(4)],
        [spec(f"c{i}", i, 9) for i in range(3)],
    ]
    results, steps = {}, {}
    for name, graphs in (("eager", False), ("static", True)):
        shape = KVShape.of(model)
        graph = (
            GraphDecoder(model, shape, max_rows=16, columns=192, fp32_lm_head=True, graphs=False)
            if graphs
            else None
        )
        before = {m: _steps(m) for m in ("static", "eager")}
        scheduler = Scheduler(
            model,
            tokenizer,
            weight_version="0",
            max_running_requests=16,
            max_prefill_tokens=512,
            prefix_cache=PrefixCache(64 << 20),
            eos_token_ids=set(),
            fp32_lm_head=True,
            graph=graph,
        )
        results[name] = asyncio.run(_generate_all(scheduler, waves))
        steps[name] = {m: _steps(m) - before[m] for m in ("static", "eager")}
    assert steps["static"]["static"] > 10 and steps["eager"]["static"] == 0
    for rid, (tokens, logprobs) in results["eager"].items():
        got_tokens, got_logprobs = results["static"][rid]
        assert got_tokens == tokens, rid
        torch.testing.assert_close(
            torch.tensor(got_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


def _steps(mode: str) -> float:
    return metrics.DECODE_STEPS.labels(mode)._value.get()
