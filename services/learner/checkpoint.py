"""Checkpoints of the learner: weights, optimizer, LR schedule, RNG states, step, version, and
the trajectory ids the checkpointed steps consumed; plus the step ledger.

Layout under `directory`:
  step-000010/        a servable Hugging Face model directory (servable.py: config.json,
                      generation_config.json, model.safetensors in the training dtype, the
                      tokenizer files of the base model), plus the training state:
    train/            torch.distributed.checkpoint (DCP) of every rank's shards of the weights
                      and of the AdamW state, the LR schedule and the step
                      (Trainer.checkpoint_state), and rng-<rank>.pt (each rank's RNG states)
    state.json        LearnerState: the data position (the leader's)
  steps.jsonl         one line per learner step (step, version, trajectory ids, stats) and one
                      {"event": "resume", "step": k} line per restart; after a resume from step k,
                      lines of steps > k written before it describe steps that were rolled back.
Every rank writes its own shards (`write_rank`, a collective when sharded) into the directory the
leader opened (`begin`); only the leader writes the servable weights, state.json and the ledger,
and renames the directory once every rank has written (`commit`). DCP reshards on load, so a run
may resume with another world size (RNG states of ranks that did not exist stay seeded).
Guarantees: a checkpoint directory appears only complete (written under a temporary name,
fsynced, renamed; the parent directory fsynced), so `latest()` never returns half a checkpoint;
the newest `keep` checkpoints are kept. Stream entries are acknowledged only after `commit` of
a checkpoint that includes their step returned (the caller's rule, see worker.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from services.learner.servable import write_servable
from shellrl.files import DIRECTORY_MODE, FILE_MODE

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{6,})$")


@dataclass(frozen=True)
class LearnerState:
    """step: learner steps taken; version: policy version of the saved weights (= step);
    consumed_ids: trajectory ids resolved (trained or dropped) by steps <= step, newest last;
    released_group_ids: groups already released (late members are dropped)."""

    step: int
    version: int
    consumed_ids: list[str] = field(default_factory=list)
    released_group_ids: list[str] = field(default_factory=list)


class CheckpointStore:
    """directory: where checkpoints live (created); keep: how many newest checkpoints to keep
    (>= 1); model_source: the base model's directory, whose tokenizer each checkpoint copies
    (default: the directory the saved model was loaded from)."""

    def __init__(
        self, directory: str | Path, keep: int = 2, model_source: str | Path | None = None
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1; got {keep}")
        self.directory, self.keep = Path(directory), keep
        self.model_source = Path(model_source) if model_source is not None else None
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def ledger_path(self) -> Path:
        return self.directory / "steps.jsonl"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first."""
        found = [
            (int(m.group(1)), p) for p in self.directory.iterdir() if (m := _STEP_DIR.match(p.name))
        ]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def begin(self, step: int) -> Path:
        """The leader: a fresh temporary directory for the checkpoint of `step` (with train/),
        which every rank then writes into (`write_rank`). Half-written ones of earlier attempts
        (a crash in the middle of a save) are removed: one learner writes here at a time."""
        for old in self.directory.glob(".tmp-step-*"):
            shutil.rmtree(old, ignore_errors=True)
        tmp = self.directory / f".tmp-step-{step:06d}-{os.getpid()}"
        (tmp / "train").mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, state: LearnerState) -> Path:
        """The leader, after every rank's `write_rank` returned: state.json, fsync, rename to
        step-N (replacing a checkpoint of that step from before a crash), prune; returns step-N."""
        final = self.directory / f"step-{state.step:06d}"
        (tmp / "state.json").write_text(json.dumps(asdict(state)))
        # the servable model (config, tokenizer, model.safetensors, which safetensors writes 0600)
        # is for other programs to read, an SGLang server under another user say: 0644 in a 0755
        # directory (shellrl.files); the training state under train/ keeps its modes
        os.chmod(tmp, DIRECTORY_MODE)
        for path in tmp.iterdir():
            if path.is_file() and not path.is_symlink():
                os.chmod(path, FILE_MODE)
        for path in sorted(tmp.rglob("*"), reverse=True):  # files before their directories
            _fsync(path)
        _fsync(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(self.directory)
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def save(self, trainer, state: LearnerState) -> Path:
        """One process (world size 1): `begin`, `write_rank`, `commit`. Blocking (disk I/O)."""
        tmp = self.begin(state.step)
        write_rank(trainer, tmp, self.model_source)
        return self.commit(tmp, state)

    def load(self, path: Path, trainer) -> LearnerState:
        """Every rank: restore `trainer` (weights, optimizer, schedule) and this rank's RNG states
        from checkpoint `path`; returns its LearnerState. Raises ValueError when the checkpoint
        has no training state or does not match the model."""
        load_rank(trainer, path)
        return read_state(path)

    def append_ledger(self, record: dict) -> None:
        """Append one JSON line to steps.jsonl and fsync it."""
        with open(self.ledger_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_ledger(self) -> list[dict]:
        if not self.ledger_path.exists():
            return []
        return [
            json.loads(line) for line in self.ledger_path.read_text().splitlines() if line.strip()
        ]


def write_rank(trainer, tmp: Path, model_source: Path | None = None) -> None:
    """This rank's part of a checkpoint in `tmp` (from `begin`): its DCP shards and RNG states
    in train/, and on the leader the servable weights (gathered whole when sharded). Every rank
    calls it (the DCP save and the gather are collectives)."""
    rank = trainer.ranks.rank
    dcp.save(trainer.checkpoint_state(), checkpoint_id=str(tmp / "train"))
    rng = tmp / "train" / f"rng-{rank}.pt"
    torch.save(_rng_state(), rng)
    _fsync(rng)
    full = trainer.full_state_dict()
    if trainer.ranks.leader:
        write_servable(trainer.model, tmp, model_source, state_dict=full)


def load_rank(trainer, path: Path) -> None:
    """This rank's side of `CheckpointStore.load` (every rank calls it: DCP load is a collective)."""
    train = Path(path) / "train"
    if not (train / ".metadata").exists():
        raise ValueError(
            f"checkpoint {path} has no train/.metadata: not a learner checkpoint, or one written "
            "before the training state moved to torch.distributed.checkpoint (its weights are "
            "servable; start a run from them with SHELLRL_MODEL_PATH)"
        )
    state = trainer.checkpoint_state()
    try:
        dcp.load(state, checkpoint_id=str(train))
    except Exception as exc:  # CheckpointException: a missing key, a shape or dtype mismatch
        raise ValueError(f"checkpoint {path} does not match the model: {exc}") from exc
    trainer.load_checkpoint_state(state)
    rng = train / f"rng-{trainer.ranks.rank}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    else:  # a rank the saving run did not have
        log.warning("no RNG state for this rank in the checkpoint", extra={"path": str(path)})


def read_state(path: Path) -> LearnerState:
    """The LearnerState (data position) of checkpoint `path`."""
    return LearnerState(**json.loads((Path(path) / "state.json").read_text()))


def surviving_steps(ledger: list[dict]) -> dict[int, dict]:
    """The step records of the surviving history: a resume from step k discards records of
    steps > k written before it. Returns {step: record}."""
    out: dict[int, dict] = {}
    for record in ledger:
        if record.get("event") == "resume":
            out = {s: r for s, r in out.items() if s <= record["step"]}
        elif "step" in record:
            out[record["step"]] = record
    return out


def _rng_state() -> dict:
    rng = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
