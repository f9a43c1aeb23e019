"""Checkpoints of the learner: weights, optimizer, LR schedule, RNG states, step, version, and
the trajectory ids the checkpointed steps consumed; plus the step ledger.

Layout under `directory`:
  step-000010/        a servable Hugging Face model directory (servable.py: config.json,
                      generation_config.json, model.safetensors in the training dtype, the
                      tokenizer files of the base model), plus the training state: trainer.pt
                      (optimizer, scheduler, step), rng.pt, state.json (LearnerState)
  steps.jsonl         one line per learner step (step, version, trajectory ids, stats) and one
                      {"event": "resume", "step": k} line per restart; after a resume from step k,
                      lines of steps > k written before it describe steps that were rolled back.
Guarantees: a checkpoint directory appears only complete (written under a temporary name,
fsynced, renamed; the parent directory fsynced), so `latest()` never returns half a checkpoint;
the newest `keep` checkpoints are kept. Stream entries are acknowledged only after `save()` of
a checkpoint that includes their step returned (the caller's rule, see worker.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from services.learner.servable import write_servable

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

    def save(self, model: torch.nn.Module, trainer_state: dict, state: LearnerState) -> Path:
        """Write a checkpoint of `state.step` atomically; returns its directory. Blocking (disk I/O)."""
        final = self.directory / f"step-{state.step:06d}"
        tmp = self.directory / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_servable(model, tmp, self.model_source)
        torch.save(trainer_state, tmp / "trainer.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(state)))
        for path in tmp.iterdir():
            _fsync(path)
        _fsync(tmp)
        if final.exists():  # a checkpoint of this step from before a crash: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(self.directory)
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: Path, model: torch.nn.Module) -> tuple[dict, LearnerState]:
        """Load weights into `model` in place and restore RNG states; returns (trainer_state, LearnerState).

        Raises ValueError when the checkpoint's tensors do not match the model (other than tied weights).
        """
        tensors = {}
        for file in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        tied |= {
            k for k in missing if model.config.tie_word_embeddings and k.endswith("lm_head.weight")
        }
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"checkpoint {path} does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        trainer_state = torch.load(path / "trainer.pt", weights_only=False)
        _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        raw = json.loads((path / "state.json").read_text())
        return trainer_state, LearnerState(**raw)

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
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
