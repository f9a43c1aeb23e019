"""The engine's decode graphs on a GPU (services/engine/graph_decode.py): replayed steps against the
eager forward in bfloat16, and weights committed after capture reach the replayed graphs.

Tolerance: bfloat16 forwards of the same math whose attention sees a different key length (the
graph's arena is wider; masked keys get zero weight) may round differently: 0.05 nats on log-probs,
the same greedy token where the eager margin between its top two logits exceeds 0.1.
"""

from __future__ import annotations

import pytest

from services.engine.graph_decode import GraphDecoder
from services.engine.kv_batch import BatchKV, KVShape, forward_columns
from services.engine.weights import WeightStore
from shellrl.models import load_model
from tests.gpu.conftest import requires_cuda

torch = pytest.importorskip("torch")
pytestmark = requires_cuda

LOGPROB_TOLERANCE = 0.05
MARGIN = 0.1


def _prefilled(model, sequences):
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
    device = shape.device
    forward_columns(model, batch, ids.to(device), positions.to(device), valid.to(device))
    return batch


def _check(got, want):
    lp_got, lp_want = torch.log_softmax(got.float(), -1), torch.log_softmax(want.float(), -1)
    assert (lp_got - lp_want).abs().max().item() < LOGPROB_TOLERANCE
    top2 = want.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > MARGIN
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@torch.inference_mode()
def test_replayed_steps_match_eager_steps_and_see_weights_committed_after_capture():
    model = load_model("tiny", dtype=torch.bfloat16, device="cuda")
    store = WeightStore(model, copy_on_commit=True)
    graph = GraphDecoder(model, KVShape.of(model), max_rows=16, columns=256, fp32_lm_head=True)
    graph.capture()
    sequences = [list(range(100 + 7 * r, 140 + 11 * r)) for r in range(11)]  # 11 rows: bucket 12
    static = _prefilled(model, sequences)
    eager = static.select(list(range(static.rows)))
    assert graph.adopt(static)
    lengths, tokens = [len(s) for s in sequences], [5] * len(sequences)
    device = torch.device("cuda")
    for step in range(20):
        if step == 10:  # new weights after capture: copied into the captured storages
            name, param = "model.norm.weight", dict(model.named_parameters())["model.norm.weight"]
            store.commit(store.stage([(name, param.detach() * 1.5)]))
        lengths = [n + 1 for n in lengths]
        positions = [n - 1 for n in lengths]
        got = graph.decode(static, tokens, positions, [True] * len(tokens)).clone()
        want = forward_columns(
            model,
            eager,
            torch.tensor(tokens, device=device)[:, None],
            torch.tensor(positions, device=device)[:, None],
            torch.ones(len(tokens), 1, dtype=torch.bool, device=device),
            fp32_lm_head=True,
        )
        _check(got, want)
        tokens = want.argmax(-1).tolist()
