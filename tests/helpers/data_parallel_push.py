"""Weight pushes of the data-parallel learner, for tests: run it under
`torchrun --nproc-per-node N tests/helpers/data_parallel_push.py OUT` (or alone: world size 1).

Every rank builds `small_model()` (seeded: the same on each rank and in the test's own process)
and a Trainer, which shards it with FSDP2. Rank 0 stages the weights through `WeightStaging` as
the learner's push does (`DataParallel.weights`: one all-gather per parameter, the followers
gathering with it) for each transport of `TRANSPORTS`, twice: once into new buckets, then, after
every rank applied `change_weights` to its shard, into the kept ones. It writes to OUT what an
engine would read back (`read_back`), the peak of gathered bytes alive during each push
(`GatherCounter`), and the same peak for gathering the whole model first (`prepare` before
streaming: a list of every gathered parameter).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script by torchrun

from services.learner.checkpoint import CheckpointStore  # noqa: E402
from services.learner.data_parallel import DataParallel, follow  # noqa: E402
from services.learner.ranks import init_ranks  # noqa: E402
from services.learner.sharding import FullWeights  # noqa: E402
from services.learner.trainer import Trainer  # noqa: E402
from services.learner.weights.weight_transport import WeightStaging  # noqa: E402
from shellrl.process_groups import exit_process  # noqa: E402
from shellrl.weights.disk import load_safetensors_dir  # noqa: E402
from shellrl.weights.safe_unpickle import decode_flattened_bucket, deserialize  # noqa: E402
from tests.helpers.data_parallel_steps import CONFIG  # noqa: E402

TRANSPORTS = ("shm", "distributed", "disk")
BUCKET_BYTES = 300_000  # several buckets for the model below (~2.2 MB)


def small_model() -> torch.nn.Module:
    """A seeded 8-layer Llama with a small vocabulary (float32, ~2.2 MB): many parameters of
    similar size, so the whole model is many times its largest parameter (67 KB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def change_weights(model: torch.nn.Module) -> None:
    """The same exact change on a full model or on each rank's shards (elementwise: x * -0.5)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)


class GatherCounter(FullWeights):
    """`FullWeights` that measures the bytes of gathered parameters alive at once: at each
    gather (the only place they are allocated) it adds the new tensor's bytes to those of the
    earlier ones whose storage is still alive (torch's StorageWeakRef, the C++ reference count:
    views and numpy arrays of a tensor keep it alive too). `peak_bytes`: the largest such sum
    during the last iteration."""

    def named_parameters(self):
        alive: list[tuple[StorageWeakRef, int]] = []
        self.peak_bytes = 0
        for name, full in super().named_parameters():
            alive = [(ref, n) for ref, n in alive if not ref.expired()]
            alive.append((StorageWeakRef(full.untyped_storage()), full.untyped_storage().nbytes()))
            self.peak_bytes = max(self.peak_bytes, sum(n for _, n in alive))
            yield name, full
            del full


def read_back(staging: WeightStaging, prepared: dict) -> dict:
    """What the engines would read, as plain tensors: shm: per bucket (metadata, bytes) decoded
    from SGLang's envelope; distributed: per bucket (fields, bytes); disk: {name: tensor}."""
    if staging.transport == "disk":
        return dict(load_safetensors_dir(prepared["model_path"]))
    if staging.transport == "distributed":
        return {"buckets": [(f, t.clone()) for f, t in prepared["broadcast"]]}
    buckets = []
    for entries in prepared["buckets"]:
        flat, metadata = decode_flattened_bucket(deserialize(entries(1)[0]))
        buckets.append((metadata, flat.clone()))
    return {"buckets": buckets}


def push_all(weights, stagings: dict[str, WeightStaging], version: int) -> dict:
    """Stage `weights` through every transport; {transport: {"read_back", "peak_bytes",
    "largest_bucket_bytes"}} (peak_bytes only for a GatherCounter)."""
    out = {}
    for transport, staging in stagings.items():
        prepared = staging.prepare(weights, version)
        out[transport] = {
            "read_back": read_back(staging, prepared),
            "peak_bytes": getattr(weights, "peak_bytes", None),
            "largest_bucket_bytes": max((k.nbytes for k in staging._kept), default=0),
        }
    return out


def stagings(root: Path) -> dict[str, WeightStaging]:
    return {
        t: WeightStaging(t, root / t, bucket_bytes=BUCKET_BYTES, share_parameters=True)
        for t in TRANSPORTS
    }


def main(out: Path) -> None:
    torch.set_num_threads(1)
    ranks = init_ranks(fsdp="auto", backend="gloo", device="cpu", timeout_s=120)
    trainer = Trainer(small_model(), CONFIG, ranks)
    store = CheckpointStore(out.parent / f"unused-{ranks.rank}")
    if not ranks.leader:
        follow(trainer, store)  # the first pushes
        change_weights(trainer.model)
        follow(trainer, store)  # the second
        ranks.close(together=True)  # with the leader's dp.stop()
        exit_process(0)
    dp = DataParallel(trainer, store, pad_token_id=2)
    weights = GatherCounter(dp.weights.model, dp.weights.announce)
    kept = stagings(out.parent / "sync")
    result = {"first": push_all(weights, kept, 1)}
    before_streaming = [(n, t) for n, t in weights.named_parameters()]  # prepare's old first line
    result["whole_model_first_peak_bytes"] = weights.peak_bytes
    del before_streaming
    dp.release_followers()
    change_weights(trainer.model)
    result["second"] = push_all(weights, kept, 2)
    dp.stop()  # the followers return and every rank leaves the group together
    for staging in kept.values():
        staging.close()
    torch.save(result, out)
    exit_process(0)  # a rank never meets the interpreter's finalization (process_groups)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
