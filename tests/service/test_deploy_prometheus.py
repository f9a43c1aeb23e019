"""Prometheus configs (promtool, freshness) and the dashboard PromQL harness against a real service.

The harness (tests/helpers/prometheus.py) starts Debian's `prometheus` scraping a real
`python -m services.sandbox` process; every dashboard panel whose metrics the sandbox exports must
return data. The whole-stack version of this test (every panel, every service) lives in the e2e suite.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from cli import prometheus_config, prometheus_scrape
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO, ServiceProcess
from tests.helpers.prometheus import (
    DASHBOARD_DIR,
    PrometheusServer,
    evaluate,
    metric_families,
    panel_queries,
    substitute_macros,
)
from tests.helpers.redis_server import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs Debian's prometheus package"
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return run_owned(["promtool", *args], capture_output=True, text=True, timeout_s=60)


def test_committed_prometheus_configs_pass_promtool_check_config():
    for name in prometheus_config.GENERATED_FILES:
        path = prometheus_config.DEPLOY_DIR / name
        done = promtool("check", "config", str(path))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


def test_committed_prometheus_configs_equal_what_the_generator_writes(tmp_path):
    prometheus_config.write_generated(tmp_path)
    for name in prometheus_config.GENERATED_FILES:
        assert (prometheus_config.DEPLOY_DIR / name).read_text() == (tmp_path / name).read_text(), (
            f"deploy/prometheus/{name} is stale: run python -m cli.prometheus_config"
        )


def test_compose_config_scrapes_every_replica_of_every_service_on_its_port():
    config = yaml.safe_load((prometheus_config.DEPLOY_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for service, port in prometheus_config.DEFAULT_PORTS.items():
        assert jobs[service]["dns_sd_configs"] == [
            {"names": [service], "type": "A", "port": port, "refresh_interval": "15s"}
        ]
    local = yaml.safe_load((prometheus_config.DEPLOY_DIR / "prometheus.local.yml").read_text())
    assert {
        job["job_name"]: job["static_configs"][0]["targets"] for job in local["scrape_configs"]
    } == {
        service: [f"127.0.0.1:{port}"] for service, port in prometheus_config.DEFAULT_PORTS.items()
    }


def test_promtool_rejects_a_config_with_a_bad_scrape_interval(tmp_path):
    bad = yaml.safe_load(prometheus_scrape.render(prometheus_config.LOCAL_TARGETS))
    bad["global"]["scrape_interval"] = "fivesec"
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(bad))
    assert promtool("check", "config", str(path)).returncode != 0


def test_config_rejects_a_target_without_a_port():
    with pytest.raises(ValueError, match="host:port"):
        prometheus_scrape.config({"sandbox": ["localhost"]})


def test_every_dashboard_query_is_valid_promql(tmp_path):
    """promtool parses each panel's PromQL (macros replaced) as a recording rule, offline."""
    queries = panel_queries()
    assert len(queries) >= 20
    rules = {
        "groups": [
            {
                "name": "dashboards",
                "rules": [
                    {"record": f"shellrl:panel_{i}", "expr": query.promql}
                    for i, query in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_macros_are_replaced_and_unknown_variables_fail():
    assert substitute_macros("rate(x[$__rate_interval]) + $__range") == "rate(x[15s]) + 5m"
    with pytest.raises(ValueError, match="unknown Grafana variable"):
        substitute_macros('x{job=~"$job"}')


@pytest.mark.slow
def test_sandbox_panels_return_data_from_a_real_sandbox_and_prometheus(tmp_path):
    # Session uids must traverse the workspace root: pytest's tmp_path (under a 0700 dir) is not.
    workspaces = Path(tempfile.mkdtemp(prefix="shellrl-deploy-ws-"))
    workspaces.chmod(0o755)
    port = free_port()
    sandbox = ServiceProcess(
        "sandbox", port, {"SHELLRL_WORKSPACE_ROOT": str(workspaces)}, tmp_path / "logs"
    )
    sandbox.start(ready_timeout_s=60)
    try:
        with PrometheusServer(tmp_path / "prom", {"sandbox": [f"127.0.0.1:{port}"]}) as prom:
            prom.wait_for_scrapes(1)
            with httpx.Client(base_url=sandbox.url, timeout=30.0) as client:
                created = client.post("/v1/sessions", json={"setup": "echo hello > greeting.txt"})
                assert created.status_code == 201, created.text
                session = created.json()["session_id"]
                # A labelled series appears with its first observation, and rate() counts no increase
                # at a series' start: scrape once between the first exec and the next ones.
                for batch in (("true",), ("cat greeting.txt", "ls -la", "wc -c greeting.txt")):
                    for command in batch:
                        done = client.post(
                            f"/v1/sessions/{session}/exec", json={"command": command}
                        )
                        assert done.status_code == 200 and done.json()["exit_code"] == 0, done.text
                    prom.wait_for_scrapes(prom.scrapes_done() + 2)

            scraped = metric_families(prom.scraped_metrics())
            sandbox_queries = [q for q in panel_queries() if q.metrics and q.metrics <= scraped]
            panels = {q.panel for q in sandbox_queries}
            assert {"Sandbox exec latency", "Sandbox sessions"} <= panels, panels
            for result in evaluate(prom, sandbox_queries):
                assert result.has_data, f"{result.query}: {result.error or 'empty result'}"

            [sessions] = prom.query("sum(shellrl_sandbox_sessions)")
            assert float(sessions["value"][1]) == 1.0
            p50 = next(
                r
                for r in evaluate(prom, sandbox_queries)
                if r.query.panel == "Sandbox exec latency" and r.query.ref_id == "A"
            )
            value = float(p50.result[0]["value"][1])
            assert math.isfinite(value) and 0 < value < 10, p50.result
    finally:
        sandbox.stop()
        shutil.rmtree(workspaces, ignore_errors=True)


def test_dashboard_directory_is_where_grafana_provisioning_reads():
    provider = yaml.safe_load(
        (DASHBOARD_DIR.parent / "provisioning" / "dashboards" / "shellrl.yaml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/shellrl"


def test_the_engine_and_learner_metrics_pass_promtool_check_metrics():
    """Prometheus' own linter over what the engine and the learner export (their metrics modules,
    shellrl_gpu_memory_bytes included): names, units, types and help texts."""
    exposition = run_owned(
        [
            sys.executable,
            "-c",
            "import services.engine.metrics, services.learner.metrics, sys; "
            "from prometheus_client import generate_latest; "
            "sys.stdout.buffer.write(generate_latest())",
        ],
        cwd=REPO,
        capture_output=True,
        timeout_s=120,
        check=True,
    ).stdout
    assert b"# TYPE shellrl_gpu_memory_bytes gauge" in exposition
    done = run_owned(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout_s=60
    )
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
