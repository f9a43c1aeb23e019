"""Three learner steps of the data-parallel learner on fixed groups, for tests: run it under
`torchrun --nproc-per-node N tests/helpers/data_parallel_steps.py OUT` (or alone: world size 1).

Rank 0 drives DataParallel (the worker's path: split by tokens, scatter, FSDP2 step, merged
result) and writes {"weights": full weights gathered through DataParallel.weights (the weight
push's path), "results": the merged StepResults} to OUT; the other ranks follow. `steps()` and
CONFIG are what the single-process reference trains on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script by torchrun

from services.learner.checkpoint import CheckpointStore  # noqa: E402
from services.learner.data_parallel import DataParallel, follow  # noqa: E402
from services.learner.ranks import init_ranks  # noqa: E402
from services.learner.trainer import Trainer  # noqa: E402
from services.learner.trainer_config import TrainerConfig  # noqa: E402
from shellrl.models import load_model  # noqa: E402
from shellrl.process_groups import exit_process  # noqa: E402
from tests.unit.test_rl_logprobs import make_samples  # noqa: E402

# AdamW's per-tensor loop on both sides: with FSDP the trainer never uses the fused kernel, so the
# single-process reference takes the same update (the fused one differs by float rounding)
CONFIG = TrainerConfig(lr=1e-3, micro_batch_size=2, grad_clip_norm=1.0, fused_optimizer=False)
STEP_SIZES = (6, 5, 1)  # 5 rows on 2 ranks: one runs an idle pass; 1 row: the other has none


def steps() -> list:
    """The samples of each step (varied lengths, advantages and masks)."""
    return [make_samples(n, seed=10 + i) for i, n in enumerate(STEP_SIZES)]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    ranks = init_ranks(fsdp="auto", backend="gloo", device="cpu", timeout_s=120)
    torch.manual_seed(0)
    trainer = Trainer(load_model("tiny"), CONFIG, ranks)
    store = CheckpointStore(out.parent / f"unused-{ranks.rank}")
    if not ranks.leader:
        follow(trainer, store)
        ranks.close(together=True)  # with the leader's dp.stop()
        exit_process(0)
    dp = DataParallel(trainer, store, pad_token_id=2)
    results = [dp.step(samples, learner_version=k) for k, samples in enumerate(steps())]
    weights = {name: tensor.clone() for name, tensor in dp.weights.named_parameters()}
    dp.stop()  # the followers return and every rank leaves the group together
    torch.save({"weights": weights, "results": results}, out)
    exit_process(0)  # a rank never meets the interpreter's finalization (process_groups)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
