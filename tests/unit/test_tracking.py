"""shellrl.tracking (issue 22, item 1): one interface, TensorBoard by default when installed, W&B
(offline) and MLflow selected by a setting; every backend's output is read back with that
backend's own reader. W&B and MLflow cases are skipped where those packages are not installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shellrl.tracking import (
    NullTracker,
    TrackingConfig,
    _Guarded,
    create_tracker,
    flatten,
    installed,
    kept_run_name,
)


def test_flatten_keeps_numbers_of_nested_mappings():
    last = {
        "step": 3,
        "reward_mean": 0.5,
        "outcomes": {"trained": 2, "zero_variance": 1},
        "paused": False,
        "stats": {"clip_fraction_low": 0.0, "kl": 0.01},
        "path": "/x",
        "ids": [1, 2],
        "loss": None,
    }
    assert flatten(last, exclude=("step",)) == {
        "reward_mean": 0.5,
        "outcomes/trained": 2.0,
        "outcomes/zero_variance": 1.0,
        "paused": 0.0,
        "stats/clip_fraction_low": 0.0,
        "stats/kl": 0.01,
    }


def test_none_and_an_unknown_backend():
    assert isinstance(create_tracker(TrackingConfig(backend="none"), "job"), NullTracker)
    with pytest.raises(ValueError, match="tracking backend 'comet'"):
        TrackingConfig(backend="comet")


def read_tensorboard(directory: Path) -> tuple[dict[str, list[tuple[int, float]]], set[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    return scalars, set(events.Tags()["tensors"])


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard not installed")
def test_auto_is_tensorboard_and_its_event_files_read_back(tmp_path):
    tracker = create_tracker(TrackingConfig(), "job", tmp_path)
    tracker.log_metrics({"eval/eval_id/success_rate": 0.25, "eval/eval_id/episodes": 64}, step=0)
    tracker.log_metrics({"eval/eval_id/success_rate": 0.5, "eval/eval_id/episodes": 64}, step=7)
    tracker.log_table(
        "eval/eval_id/per_template", ["template", "successes"], [["count_lines", 3]], step=7
    )
    tracker.close()
    scalars, texts = read_tensorboard(tmp_path / "job")
    assert scalars["eval/eval_id/success_rate"] == [(0, 0.25), (7, 0.5)]
    assert scalars["eval/eval_id/episodes"] == [(0, 64.0), (7, 64.0)]
    assert "eval/eval_id/per_template/text_summary" in texts


def test_a_failing_backend_turns_tracking_off_without_raising(caplog):
    class RaisesOnLog:  # injects the fault: a backend whose writes fail (disk full, network)
        calls = 0

        def log_metrics(self, metrics, step):
            RaisesOnLog.calls += 1
            raise OSError("disk full")

    tracker = _Guarded(RaisesOnLog())
    tracker.log_metrics({"a": 1.0}, 1)
    tracker.log_metrics({"a": 2.0}, 2)
    assert RaisesOnLog.calls == 1 and tracker.failed
    assert "tracking is off" in caplog.text


@pytest.mark.parametrize("backend, package", [("wandb", "wandb"), ("mlflow", "mlflow-skinny")])
def test_selecting_a_backend_that_is_not_installed_fails_naming_the_package(
    backend, package, tmp_path
):
    if installed(backend):
        pytest.skip(f"{backend} is installed")
    with pytest.raises(ValueError, match=f"pip install {package}"):
        create_tracker(TrackingConfig(backend=backend), "learner", tmp_path)


def wandb_records(path: Path) -> list:
    """The Record messages of a W&B offline run file (`run-<id>.wandb`): a 7-byte header (":W&B",
    magic 0xBEE1, version 0), then a LevelDB-style log in 32 KiB blocks of chunks [crc32 4 bytes,
    length 2 bytes LE, type 1 byte (1 full, 2 first, 3 middle, 4 last)]."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block tail too short for a chunk header is padding
            offset += block - offset % block
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
        chunk, offset = data[offset + 7 : offset + 7 + length], offset + 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@pytest.mark.skipif(
    not installed("wandb"), reason="wandb not installed (pip install '.[tracking]')"
)
def test_wandb_offline_writes_a_run_with_no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracker = create_tracker(TrackingConfig(backend="wandb", run_name="t"), "learner", tmp_path)
    tracker.log_metrics({"reward_mean": 0.25}, step=1)
    tracker.log_metrics({"reward_mean": 0.75}, step=2)
    tracker.log_table("eval/per_template", ["template", "successes"], [["count_lines", 3]], step=2)
    tracker.close()
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            if "reward_mean" in items:
                history.append((int(items["_step"]), float(items["reward_mean"])))
    assert history == [(1, 0.25), (2, 0.75)]
    [table] = run_file.parent.glob("files/media/table/eval/per_template_2_*.table.json")
    assert '"count_lines",3' in table.read_text()


@pytest.mark.skipif(
    not installed("mlflow"), reason="mlflow not installed (pip install '.[tracking]')"
)
def test_mlflow_file_store_reads_back_metrics_and_tables(tmp_path):
    from mlflow.tracking import MlflowClient

    tracker = create_tracker(TrackingConfig(backend="mlflow", run_name="t"), "learner", tmp_path)
    tracker.log_metrics({"reward_mean": 0.25, "stats/kl": 0.01, "skipped": math.nan}, step=1)
    tracker.log_metrics({"reward_mean": 0.75, "stats/kl": 0.02}, step=2)
    tracker.log_table("eval/per_template", ["template", "successes"], [["count_lines", 3]], step=2)
    tracker.close()
    client = MlflowClient(
        tracking_uri=(tmp_path / "mlruns").resolve().as_uri()
    )  # the env opt-in is set
    [run] = client.search_runs([client.get_experiment_by_name("shellrl").experiment_id])
    assert run.info.run_name == "t-learner" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "stats/kl")] == [0.01, 0.02]
    local = client.download_artifacts(
        run.info.run_id, "tables/eval/per_template/step-2.json", str(tmp_path)
    )
    assert '"count_lines", 3' in Path(local).read_text()


def read_texts(directory: Path, tag: str) -> list[tuple[int, str]]:
    """(step, text) of a TensorBoard text tag (written by SummaryWriter.add_text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    events.Reload()
    return [
        (e.step, make_ndarray(e.tensor_proto).item().decode())
        for e in events.Tensors(f"{tag}/text_summary")
    ]


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard not installed")
def test_the_config_goes_to_config_json_and_to_tensorboard(tmp_path):
    tracker = create_tracker(TrackingConfig(backend="tensorboard"), "learner", tmp_path)
    tracker.log_config({"lr": 2e-5, "tracker": "tensorboard", "path": Path("/x")})
    tracker.log_table("samples", ["prompt", "transcript"], [["a | b", "ls\nfile.txt"]], step=1)
    tracker.close()
    config = json.loads((tmp_path / "learner" / "config.json").read_text())
    assert config == {"lr": 2e-5, "tracker": "tensorboard", "path": "/x"}
    ((step, text),) = read_texts(tmp_path / "learner", "config")
    assert step == 0 and json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == config
    ((step, table),) = read_texts(tmp_path / "learner", "samples")
    assert step == 1 and table.splitlines()[2] == "| a \\| b | ls<br>file.txt |"


def test_a_run_name_not_given_is_kept_for_every_later_tracker(tmp_path):
    first = kept_run_name(tmp_path)
    assert first.startswith("shellrl-") and kept_run_name(tmp_path) == first
    assert (tmp_path / "run_name").read_text().strip() == first


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard not installed")
def test_another_processs_config_goes_under_its_name(tmp_path):
    tracker = create_tracker(TrackingConfig(backend="tensorboard"), "job", tmp_path)
    tracker.log_config({"steps": 40})
    tracker.log_config({"require_command": True}, name="config/verifier")
    tracker.close()
    assert json.loads((tmp_path / "job" / "config.json").read_text()) == {"steps": 40}
    verifier = json.loads((tmp_path / "job" / "config" / "verifier.json").read_text())
    assert verifier == {"require_command": True}
    ((_, text),) = read_texts(tmp_path / "job", "config/verifier")
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == verifier


@pytest.mark.skipif(
    not installed("mlflow"), reason="mlflow not installed (pip install '.[tracking]')"
)
def test_mlflow_config_is_the_runs_params_in_the_store_mlflow_tracking_uri_names(
    tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    store = tmp_path / "store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{store}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker sets it
    tracker = create_tracker(TrackingConfig(backend="mlflow", run_name="t"), "job", tmp_path)
    config = {"lr": 2e-5, "kl": {"coef": 0.1}, "paused": False, "token": None, "ids": [1, 2]}
    tracker.log_config(config | {"model": "tiny", "empty": {}})
    tracker.log_config({"require_command": True}, name="config/verifier")
    # logged again, changed (a restarted service): MLflow params are immutable; tracking stays on
    tracker.log_config({"require_command": False}, name="config/verifier")
    tracker.log_metrics({"reward_mean": 0.5}, step=1)
    assert not tracker.failed
    tracker.close()
    assert not (tmp_path / "mlruns").exists()
    client = MlflowClient(tracking_uri=f"file:{store}")
    [run] = client.search_runs([client.get_experiment_by_name("shellrl").experiment_id])
    assert run.data.params == {
        "lr": "2e-05",
        "kl/coef": "0.1",
        "paused": "false",
        "token": "null",
        "ids": "[1, 2]",
        "model": "tiny",
        "empty": "{}",
        "config/verifier/require_command": "true",
    }
    assert [m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [0.5]


@pytest.mark.skipif(
    not installed("wandb"), reason="wandb not installed (pip install '.[tracking]')"
)
def test_wandb_writes_under_wandb_dir_when_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    tracker = create_tracker(TrackingConfig(backend="wandb", run_name="t"), "learner", tmp_path)
    tracker.close()
    assert len(list((tmp_path / "elsewhere" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert not (tmp_path / "wandb").exists()
