"""Experiment tracking: one small interface, three backends, chosen by a setting.

    tracker = create_tracker(TrackingConfig(backend="auto"), "learner", default_directory=path)
    tracker.log_config({"lr": 2e-5, "kl_coef": 0.1})     # also <directory>/<source>/config.json
    tracker.log_metrics({"reward_mean": 0.4, "stats/clip_fraction_low": 0.0}, step=12)
    tracker.log_table("eval_id/per_template", ["template", "before", "after"], rows, step=12)
    tracker.close()

Backends (imported only when selected; none of them is needed to train):
  tensorboard  event files under <directory>/<source>/ (torch.utils.tensorboard; needs the
               `tensorboard` package). The default when it is installed ("auto").
  wandb        Weights & Biases, offline by default (`wandb_mode`, which WANDB_MODE does not
               override; runs under $WANDB_DIR/wandb, else <directory>/wandb; `wandb sync`
               uploads them later); the config is the run config (in the run file offline).
  mlflow       MLflow: `mlflow_tracking_uri`, else $MLFLOW_TRACKING_URI, else a file store under
               <directory>/mlruns (no server or database; MLflow 3 asks for
               MLFLOW_ALLOW_FILE_STORE=true for a file store, which is set for this process unless
               the environment says otherwise); the config is the run's params (nested keys
               joined by `/`) and a <name>.json artifact.
  none         nothing is logged.
Each process (the learner, the job) logs its own run, named `<run_name>-<source>` and grouped by
`run_name`; a run name not given is made once and kept in <directory>/run_name, so a restarted
learner (and the job beside it, which shares the directory) logs under the same name. Each run's
resolved settings go to the backend and to <directory>/<source>/config.json (`log_config`).
Tracking never stops training: a backend call that fails is logged once as a warning and the
tracker turns itself off. Selecting a backend that is not installed fails at start-up
(ValueError naming the package to install).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

Backend = Literal["auto", "none", "tensorboard", "wandb", "mlflow"]
BACKENDS: tuple[str, ...] = ("auto", "none", "tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


@dataclass(frozen=True)
class TrackingConfig:
    """backend: see the module docstring; directory: where backends write ('' = the caller's
    default); project: W&B project / MLflow experiment; run_name: '' = `shellrl-<unix time>`;
    wandb_mode: "offline" (no network needed) or "online"; mlflow_tracking_uri: '' = file store."""

    backend: Backend = "auto"
    directory: str = ""
    project: str = "shellrl"
    run_name: str = ""
    wandb_mode: Literal["offline", "online"] = "offline"
    mlflow_tracking_uri: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"tracking backend {self.backend!r}: expected one of {', '.join(BACKENDS)}"
            )


class Tracker(Protocol):
    """What the learner and the job log. step: the policy version the values belong to."""

    def log_config(self, config: Mapping, step: int = 0, name: str = "config") -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence], step: int
    ) -> None: ...

    def close(self) -> None: ...


def flatten(values: Mapping, prefix: str = "", exclude: Sequence[str] = ()) -> dict[str, float]:
    """Numbers of a nested mapping as {"a/b": float}; strings, None and lists are left out, bools
    become 0/1. exclude: top-level keys to leave out."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key in exclude:
            continue
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        elif isinstance(value, (bool, int, float)) and not isinstance(value, str):
            out[name] = float(value)
    return out


def installed(backend: str) -> bool:
    return importlib.util.find_spec(backend) is not None


def create_tracker(
    config: TrackingConfig, source: str, default_directory: str | Path = ".shellrl/tracking"
) -> Tracker:
    """The tracker `config` selects for the process `source` ("learner", "job"). Raises ValueError
    when the selected backend's package is missing."""
    backend = config.backend
    if backend == "auto":
        backend = "tensorboard" if installed("tensorboard") else "none"
    if backend == "none":
        return NullTracker()
    if not installed(backend):
        raise ValueError(
            f"tracking backend {backend!r} needs the package {PACKAGES[backend]!r}: "
            f"pip install {PACKAGES[backend]}"
        )
    directory = Path(config.directory or default_directory)
    run_name = config.run_name or kept_run_name(directory)
    cls = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}[
        backend
    ]
    return _Guarded(cls(config, directory, run_name, source), directory / source)


def kept_run_name(directory: Path) -> str:
    """The run name kept in `<directory>/run_name`; the first caller writes `shellrl-<unix time>`
    there (exclusive create, so two processes starting together agree)."""
    path = directory / "run_name"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "x") as f:
            f.write(f"shellrl-{int(time.time())}\n")
    except FileExistsError:
        pass
    for _ in range(50):  # the writer of an exclusive create may not have written yet
        if name := path.read_text().strip():
            return name
        time.sleep(0.01)
    raise ValueError(f"tracking run name file {path} is empty: delete it")


class NullTracker:
    def log_config(self, config: Mapping, step: int = 0, name: str = "config") -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence], step: int
    ) -> None:
        pass

    def close(self) -> None:
        pass


class _Guarded:
    """Wraps a backend: the first exception is logged and turns tracking off for this process.
    run_dir: where `log_config` writes config.json (the run's directory under the tracker's)."""

    def __init__(self, backend, run_dir: Path | None = None) -> None:
        self.backend, self.failed, self.run_dir = backend, False, run_dir

    def _call(self, method: str, *args) -> None:
        if self.failed:
            return
        try:
            getattr(self.backend, method)(*args)
        except Exception as exc:  # noqa: BLE001 (tracking must never stop training)
            self.failed = True
            log.warning(
                "experiment tracking failed; tracking is off for this process",
                extra={"backend": type(self.backend).__name__, "error": repr(exc)},
            )

    def log_config(self, config: Mapping, step: int = 0, name: str = "config") -> None:
        """`config` (resolved settings; JSON-able, other values as their str) to
        <run_dir>/<name>.json and to the backend. step: the policy version it applies from (a
        restarted learner logs it again); name: "config" (this process's), or another's, e.g.
        "config/rollout" (the job logs each service's)."""
        config = json.loads(json.dumps(config, default=str))
        if self.run_dir is not None:
            path = self.run_dir / f"{name}.json"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            except OSError as exc:
                log.warning("could not write a run's config", extra={"error": repr(exc)})
        self._call("log_config", config, step, name)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._call("log_metrics", metrics, step)

    def log_table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence], step: int
    ) -> None:
        self._call("log_table", name, columns, rows, step)

    def close(self) -> None:
        self._call("close")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table; in a cell `|` is escaped and a line break becomes `<br>`."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


class TensorBoardTracker:
    """Scalars per step, tables as markdown text and the config as a JSON block (text tag
    "config"), in <directory>/<source>/events.out.tfevents.*; flushed after every call, so a
    killed process loses nothing it logged."""

    def __init__(self, config: TrackingConfig, directory: Path, run_name: str, source: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory / source), flush_secs=5)
        self.writer.add_text("run", f"{run_name} ({source})", 0)

    def log_config(self, config: Mapping, step: int = 0, name: str = "config") -> None:
        text = json.dumps(config, indent=2, sort_keys=True)
        self.writer.add_text(name, "```json\n" + text + "\n```", step)
        self.writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, float(value), step)
        self.writer.flush()

    def log_table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence], step: int
    ) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, config: TrackingConfig, directory: Path, run_name: str, source: str) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=config.project,
            name=f"{run_name}-{source}",
            group=run_name,
            job_type=source,
            dir=os.environ.get("WANDB_DIR") or str(directory),
            mode=config.wandb_mode,
            reinit="create_new",
        )

    def log_config(self, config: Mapping, step: int = 0, name: str = "config") -> None:
        values = dict(config) if name == "config" else {name: dict(config)}
        self.run.config.update(values, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence], step: int
    ) -> None:
        self.run.log(
            {name: self.wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step
        )

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # waits until wandb-core has written the whole run file


class MlflowTracker:
    """One MLflow run per process in experiment `project`; tables as JSON artifacts
    tables/<name>/step-<N>.json ({"columns": [...], "rows": [[...]]})."""

    def __init__(self, config: TrackingConfig, directory: Path, run_name: str, source: str) -> None:
        from mlflow.tracking import MlflowClient

        uri = config.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            uri = (directory / "mlruns").resolve().as_uri()
        if urlsplit(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(config.project)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(config.project)
        )
        self.run_id = self.client.create_run(
            experiment_id,
            run_name=f"{run_name}-{source}",
            tags={"shellrl.group": run_name, "shellrl.source": source},
        ).info.run_id
        self.logged_params: set[str] = set()

    def log_config(self, config: Mapping, step: int = 0, name: str = "config") -> None:
        """The run's params (another process's under `<name>/`) and the artifact <name>.json
        (rewritten). MLflow's params cannot change: a key logged before keeps its first value."""
        from mlflow.entities import Param

        prefix = "" if name == "config" else name
        values = {_mlflow_key(k)[:250]: v[:6000] for k, v in _param_values(config, prefix).items()}
        params = [Param(k, v) for k, v in values.items() if k not in self.logged_params]
        self.logged_params.update(values.keys())
        for lo in range(0, len(params), 100):  # MLflow's limit of params in one batch
            self.client.log_batch(self.run_id, params=params[lo : lo + 100])
        self.client.log_dict(self.run_id, dict(config), f"{name}.json")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [
            Metric(_mlflow_key(k), float(v), now_ms, step)
            for k, v in metrics.items()
            if math.isfinite(v)
        ]
        for lo in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=batch[lo : lo + 1000])

    def log_table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence], step: int
    ) -> None:
        text = json.dumps({"columns": list(columns), "rows": [list(r) for r in rows]}, default=str)
        self.client.log_text(self.run_id, text, f"tables/{name}/step-{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _param_values(values: Mapping, prefix: str = "") -> dict[str, str]:
    """A nested mapping as MLflow params {"a/b": str}: strings as they are, other values as JSON
    (`true`, `null`, `[1, 2]`, `2e-05`)."""
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(_param_values(value, name))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def _mlflow_key(name: str) -> str:
    """MLflow keys allow letters, digits, `_ - . /` and spaces."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)
