"""The learner's tracking through W&B and MLflow (issue 34, item 1): a real learner process (tiny
model) against real Redis and a real engine trains two steps with `SHELLRL_TRACKER=mlflow` (an
MLflow file store named by MLFLOW_TRACKING_URI) or `wandb` (WANDB_MODE=offline, WANDB_DIR); what
it logged is read back with the backend's own reader: MLflow's client (the config as the run's
params and config.json, the step scalars' histories, the samples table artifacts), and the W&B
offline run directory (the run file's run, config, history and summary records: offline, W&B
writes no files/config.yaml or wandb-summary.json; the samples tables under files/media).
Skipped where the `tracking` extra is not installed. Nothing here needs the network (offline W&B,
a file store; WANDB_BASE_URL points at a closed local port so a stray upload would fail, not leave
the machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.learner.sample_table import COLUMNS
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.tracking import _param_values, installed
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until_async
from tests.service.test_learner import (  # noqa: F401 (engine: a module fixture)
    add_group,
    engine,
    learner_env,
    step_reaches,
)
from tests.unit.test_tracking import wandb_records

pytestmark = pytest.mark.slow

SCALARS = ("reward_mean", "loss", "kl", "grad_norm", "lr", "staleness_max", "outcomes/trained")


async def train_two_steps(engine, redis_server, tmp_path: Path, env: dict, **settings) -> dict:  # noqa: F811
    """A learner with `settings` (SHELLRL_*) and `env` trains groups g1 and g2 (steps 1, 2) and is
    stopped with SIGTERM (its last checkpoint, then the tracker's close); its last step record."""
    redis = streams.connect(redis_server.url)
    client = EngineClient([engine.url], timeout_s=120)
    learner_settings = learner_env(redis_server.url, engine.url, tmp_path, **settings)
    learner = ServiceProcess("learner", free_port(), learner_settings | env, tmp_path)
    try:
        learner.start(ready_timeout_s=120)
        await add_group(redis, client, "g1")
        await step_reaches(learner, 1)
        await wait_until_async(  # g2 sampled by version 1: staleness 0
            lambda: _version_is(client, engine.url, "1"), what="the engine serving version 1"
        )
        await add_group(redis, client, "g2")
        return (await step_reaches(learner, 2))["last_step"]
    finally:
        learner.stop()
        await client.close()
        await redis.aclose()


def no_upload_env() -> dict[str, str]:
    return {"WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}", "WANDB_SILENT": "true"}


@pytest.mark.skipif(not installed("mlflow"), reason="mlflow not installed (the tracking extra)")
async def test_learner_logs_config_scalars_and_samples_to_mlflow(
    engine,  # noqa: F811
    redis_server,
    tmp_path,
    monkeypatch,
):
    MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient

    store = tmp_path / "mlflow-store"
    # the learner sets MLflow 3's file store opt-in itself; this process's reader needs it too
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    env = {"MLFLOW_TRACKING_URI": f"file:{store}"}
    last = await train_two_steps(
        engine, redis_server, tmp_path, env | no_upload_env(), tracker="mlflow", sample_table_rows=2
    )
    assert not (tmp_path / "tracking" / "mlruns").exists()  # MLFLOW_TRACKING_URI was honoured
    config = json.loads((tmp_path / "tracking" / "learner" / "config.json").read_text())
    assert config["tracker"] == "mlflow" and config["sample_table_rows"] == 2
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{store}")
    [run] = client.search_runs([client.get_experiment_by_name("shellrl").experiment_id])
    run_name = (tmp_path / "tracking" / "run_name").read_text().strip()
    assert run.info.run_name == f"{run_name}-learner" and run.info.status == "FINISHED"
    params = run.data.params
    assert params == _param_values(config) and len(params) == len(config)
    assert params["tracker"] == "mlflow" and params["sample_table_rows"] == "2"
    assert params["checkpoint_dir"] == str(tmp_path / "ckpt")
    assert float(params["lr"]) == config["lr"]
    run_id = run.info.run_id
    logged = client.download_artifacts(run_id, "config.json", str(tmp_path / "artifacts"))
    assert json.loads(Path(logged).read_text()) == config
    for key in SCALARS:
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2], key
    reward = client.get_metric_history(run_id, "reward_mean")[-1].value
    assert reward == pytest.approx(last["reward_mean"])
    loss = client.get_metric_history(run_id, "loss")[-1].value
    assert loss == pytest.approx(last["loss"], rel=1e-6, abs=1e-9)
    assert [f.path for f in client.list_artifacts(run_id, "tables/samples")] == [
        "tables/samples/step-1.json",
        "tables/samples/step-2.json",
    ]
    local = client.download_artifacts(run_id, "tables/samples/step-1.json", str(tmp_path / "t"))
    table = json.loads(Path(local).read_text())
    assert table["columns"] == list(COLUMNS) and len(table["rows"]) == 2
    assert table["rows"][0][0] == "g1" and len(table["rows"][0]) == len(COLUMNS)


@pytest.mark.skipif(not installed("wandb"), reason="wandb not installed (the tracking extra)")
async def test_learner_logs_config_scalars_and_samples_to_wandb_offline(
    engine,  # noqa: F811
    redis_server,
    tmp_path,
):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)}
    last = await train_two_steps(
        engine, redis_server, tmp_path, env | no_upload_env(), tracker="wandb", sample_table_rows=2
    )
    assert not (tmp_path / "tracking" / "wandb").exists()  # WANDB_DIR was honoured
    config = json.loads((tmp_path / "tracking" / "learner" / "config.json").read_text())
    assert config["tracker"] == "wandb" and config["sample_table_rows"] == 2
    [run_dir] = (wandb_dir / "wandb").glob("offline-run-*")
    [run_file] = run_dir.glob("run-*.wandb")  # offline, W&B writes no config.yaml or summary file
    logged, summary, history = {}, {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_name = (tmp_path / "tracking" / "run_name").read_text().strip()
            assert record.run.display_name == f"{run_name}-learner"
            assert record.run.run_group == run_name and record.run.job_type == "learner"
        elif kind == "config":
            logged |= {i.key: json.loads(i.value_json) for i in record.config.update}
        elif kind == "summary":
            summary |= {_key(i): json.loads(i.value_json) for i in record.summary.update}
        elif kind == "history":
            items = {_key(i): i.value_json for i in record.history.item}
            if any(k == "samples" or k.startswith("samples/") for k in items):
                items["samples"] = "table"  # the table's reference (nested keys or one value)
            for key in (*SCALARS, "samples"):
                if key in items:
                    history.setdefault(key, []).append(int(items["_step"]))
    assert {k: v for k, v in logged.items() if k != "_wandb"} == config
    for key in (*SCALARS, "samples"):
        assert history[key] == [1, 2], key
    assert summary["_step"] == 2
    assert summary["reward_mean"] == pytest.approx(last["reward_mean"])
    assert summary["loss"] == pytest.approx(last["loss"], rel=1e-6, abs=1e-9)
    for step in (1, 2):
        [path] = (run_dir / "files" / "media" / "table").glob(f"samples_{step}_*.table.json")
        table = json.loads(path.read_text())
        assert table["columns"] == list(COLUMNS) and len(table["data"]) == 2
    assert table["data"][0][0] == "g2"


def _key(item) -> str:
    """A W&B history or summary item's name: `key`, or its `nested_key` parts joined by `/`."""
    return item.key or "/".join(item.nested_key)


async def _version_is(client: EngineClient, url: str, version: str) -> bool:
    return (await client.get_weight_version()) == {url: version}
