"""A learner rank other than 0 (`torchrun ... -m services.learner` starts one per process): no
HTTP, no Redis; it builds the same trainer and carries out rank 0's commands
(data_parallel.follow) until rank 0 stops it.

SIGTERM (torchrun forwards it to every rank) does not stop a follower: rank 0 drains, writes its
last checkpoint (which needs every rank) and then sends STOP. Exit status 0 after STOP; 1 with a
one-line error when the rendezvous fails; an exception (non-zero) when a collective fails, so
torchrun restarts the group.
"""

from __future__ import annotations

import logging
import random
import signal

import numpy as np
import torch

from services.learner.checkpoint import CheckpointStore
from services.learner.data_parallel import follow
from services.learner.parts import trainer_config
from services.learner.ranks import join_ranks
from services.learner.settings import LearnerSettings
from services.learner.trainer import Trainer
from shellrl.models import load_model
from shellrl.service.logging import setup_logging

log = logging.getLogger(__name__)


def run_follower(settings: LearnerSettings) -> None:
    """Join the ranks, build the trainer, follow rank 0 until STOP (see the module docstring)."""
    setup_logging("learner", settings.log_level)
    ranks = join_ranks(settings)
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: rank 0 decides when to stop"))
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    torch.manual_seed(settings.seed)
    np.random.seed(settings.seed)
    random.seed(settings.seed)
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(settings.model_path, dtype=torch.float32, device=device)  # as app.py does
    trainer = Trainer(model, trainer_config(settings), ranks)
    store = CheckpointStore(settings.checkpoint_dir, settings.keep_checkpoints)
    log.info("following rank 0", extra={"rank": ranks.rank, "world_size": ranks.world_size})
    follow(trainer, store)
    ranks.close(together=True)  # with rank 0, which leaves right after sending STOP
