"""Grafana dashboards as code: the committed JSON is what deploy/grafana/dashboards.py generates,
the panels the issue asks for exist, and the SDK build matches the Grafana image compose runs."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.owned_processes import run_owned
from tests.helpers.prometheus import panel_queries

REPO = Path(__file__).resolve().parents[2]
GRAFANA_DIR = REPO / "deploy" / "grafana"
GENERATOR = GRAFANA_DIR / "dashboards.py"


def generate(*args: str) -> subprocess.CompletedProcess:
    return run_owned(
        [sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout_s=120
    )


def load(name: str) -> dict:
    return json.loads((GRAFANA_DIR / "dashboards" / f"{name}.json").read_text())


def panels(board: dict) -> dict[str, dict]:
    return {p["title"]: p for p in board["panels"] if p["type"] != "row"}


def test_committed_dashboards_equal_what_the_generator_produces():
    done = generate("--check")
    assert done.returncode == 0, done.stderr


def test_generator_check_fails_on_a_stale_dashboard(tmp_path):
    out = tmp_path / "dashboards"
    shutil.copytree(GRAFANA_DIR / "dashboards", out)
    board = json.loads((out / "staleness.json").read_text())
    board["panels"][1]["title"] = "edited by hand"
    (out / "staleness.json").write_text(json.dumps(board))
    done = generate("--check", "--out", str(out))
    assert done.returncode == 1 and "staleness.json" in done.stderr


def test_dashboards_have_the_panels_of_the_issue():
    staleness, throughput = load("staleness"), load("throughput")
    assert (staleness["title"], staleness["uid"]) == ("shellrl / Staleness", "shellrl-staleness")
    assert (throughput["title"], throughput["uid"]) == (
        "shellrl / Throughput",
        "shellrl-throughput",
    )
    assert {
        "Policy version",
        "Staleness distribution",
        "Staleness percentiles",
        "Sample age",
        "Dropped for staleness",
        "Importance-weight truncation",
    } <= set(panels(staleness))
    assert {
        "Episodes finished",
        "Turns",
        "Tokens per second by kind",
        "Sandbox exec latency",
        "Engine request latency",
        "Learner step time",
        "Weight-sync time by phase",
        "Stream backlog",
    } <= set(panels(throughput))
    assert panels(staleness)["Staleness distribution"]["type"] == "heatmap"


def test_every_panel_queries_the_provisioned_prometheus_datasource():
    datasource = yaml.safe_load(
        (GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    [source] = datasource["datasources"]
    assert (source["type"], source["url"]) == ("prometheus", "http://prometheus:9090")
    for name in ("staleness", "throughput"):
        for title, panel in panels(load(name)).items():
            assert panel["targets"], title
            assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, title
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == source["uid"] and target["expr"], title


def test_panel_ids_are_unique_and_queries_name_shellrl_metrics():
    for name in ("staleness", "throughput"):
        ids = [p["id"] for p in load(name)["panels"]]
        assert len(ids) == len(set(ids))
    for query in panel_queries():
        assert query.metrics, query


def test_sdk_build_matches_the_grafana_image_that_compose_runs():
    sdk = importlib.metadata.version("grafana-foundation-sdk")
    grafana_version = sdk.split("!")[-1]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    image = compose["services"]["grafana"]["image"]
    assert image == f"${{GRAFANA_IMAGE:-grafana/grafana:{grafana_version}}}"
    assert f"grafana-foundation-sdk=={sdk}" in (REPO / "pyproject.toml").read_text()


def test_every_shellrl_metric_a_panel_reads_is_defined_by_a_service():
    """Static guard against renames: the e2e PromQL test finds them too, but only with the whole stack."""
    sources = [*REPO.glob("services/*/metrics.py"), *REPO.glob("shellrl/**/*.py")]
    defined = set()
    for path in sources:
        defined.update(re.findall(r"[\"'](shellrl_[a-z0-9_]+)[\"']", path.read_text()))
    for query in panel_queries():
        missing = {m for m in query.metrics if m.startswith("shellrl_")} - defined
        assert not missing, f"{query}: {sorted(missing)} defined by no service"
