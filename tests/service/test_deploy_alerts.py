"""Alert rules (issue 22, item 9): deploy/prometheus/alerts.yml passes `promtool check rules` and
its unit tests (`promtool test rules alerts.test.yml`), alerts only on metrics the services export,
and is loaded by every deployed Prometheus: compose (mounted next to prometheus.yml), the local
stack, and Kubernetes (deploy/k8s/prometheus.yaml, generated, the same text embedded)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import REGISTRY

from cli import prometheus_config
from tests.helpers.owned_processes import run_owned
from tests.service.test_deploy_compose import rendered
from tests.service.test_deploy_k8s import K8S_DIR, container, manifests

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs Debian's prometheus package"
)

RULES = prometheus_config.DEPLOY_DIR / "alerts.yml"
RULE_TESTS = prometheus_config.DEPLOY_DIR / "alerts.test.yml"
REQUIRED = {
    "ShellrlServiceDown",
    "ShellrlServiceMissing",
    "ShellrlWeightSyncFailing",
    "ShellrlStalenessDrops",
    "ShellrlDeadLettersGrowing",
    "ShellrlStreamEntriesLost",
}


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return run_owned(["promtool", *args], capture_output=True, text=True, timeout_s=120, cwd=cwd)


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def test_alert_rules_pass_promtool_check_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_alert_rules_pass_their_promtool_unit_tests():
    done = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_fail_when_an_alert_does_not_fire_as_expected(tmp_path):
    """The unit tests have teeth: the same tests against a rule file whose weight-sync alert never
    fires fail."""
    broken = RULES.read_text().replace(
        "increase(shellrl_weight_sync_failures_total[10m])) > 0",
        "increase(shellrl_weight_sync_failures_total[10m])) > 100",
    )
    assert broken != RULES.read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0 and "ShellrlWeightSyncFailing" in done.stdout + done.stderr


def test_every_required_alert_exists_with_a_severity_and_a_summary():
    found = {rule["alert"]: rule for rule in rules()}
    assert REQUIRED <= set(found)
    for name, rule in found.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        tested = re.search(rf"alertname: {name}\b", RULE_TESTS.read_text())
        assert tested, f"{name} has no case in {RULE_TESTS.name}"


def test_alerts_use_only_metrics_the_services_export():
    import services.learner.metrics  # noqa: F401 (registers the learner's metrics)
    import shellrl.streams.metrics  # noqa: F401

    exported = set(REGISTRY._names_to_collectors) | {"up"}
    for rule in rules():
        names = set(re.findall(r"\b(shellrl_[a-z_]+|up)\b(?=\s*[{\[)=])", rule["expr"]))
        assert names, rule["alert"]
        assert names <= exported, f"{rule['alert']}: {sorted(names - exported)} not exported"


def test_compose_prometheus_loads_the_rules_next_to_its_config(tmp_path):
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    prometheus = rendered(env_file)["services"]["prometheus"]
    mounts = {v["target"]: v["source"] for v in prometheus["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/prometheus/alerts.yml"] == str(RULES)
    assert mounts["/etc/prometheus/prometheus.yml"] == str(
        prometheus_config.DEPLOY_DIR / "prometheus.yml"
    )
    for name in prometheus_config.GENERATED_FILES:
        config = yaml.safe_load((prometheus_config.DEPLOY_DIR / name).read_text())
        assert config["rule_files"] == ["alerts.yml"], name


def k8s_prometheus() -> dict[str, dict]:
    return {doc["kind"]: doc for name, doc in manifests() if name == prometheus_config.K8S_FILE}


def test_k8s_prometheus_embeds_the_same_rules_and_a_config_promtool_accepts(tmp_path):
    docs = k8s_prometheus()
    data = docs["ConfigMap"]["data"]
    assert data["alerts.yml"] == RULES.read_text()
    config = yaml.safe_load(data["prometheus.yml"])
    [pods] = [job for job in config["scrape_configs"] if job["job_name"] == "shellrl-pods"]
    assert pods["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["shellrl"]}}]
    # Debian's promtool is built without Kubernetes discovery ("field kubernetes_sd_configs not
    # found"): check everything else (globals, relabelling, the rule file next to the config) with
    # a static target in its place.
    checked = yaml.safe_load(data["prometheus.yml"])
    checked["scrape_configs"][0] = {k: v for k, v in pods.items() if k != "kubernetes_sd_configs"}
    checked["scrape_configs"][0]["static_configs"] = [{"targets": ["localhost:8100"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(checked))
    (tmp_path / "alerts.yml").write_text(data["alerts.yml"])
    done = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout
    main = container(docs["Deployment"])
    assert {"name": "config", "mountPath": "/etc/prometheus", "readOnly": True} in main[
        "volumeMounts"
    ]
    assert "--config.file=/etc/prometheus/prometheus.yml" in main["args"]
    relabel = {r["target_label"]: r for r in pods["relabel_configs"] if "target_label" in r}
    assert relabel["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    assert docs["Role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]


def test_every_scraped_k8s_workload_is_named_as_its_alert_job():
    """ShellrlServiceDown/Missing select `job` = the service name: the pods Prometheus scrapes must
    carry that name as app.kubernetes.io/name."""
    for _, doc in manifests():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = doc["spec"]["template"]["metadata"]
        if template.get("annotations", {}).get("prometheus.io/scrape") == "true":
            assert template["labels"]["app.kubernetes.io/name"] == doc["metadata"]["name"]
            assert doc["metadata"]["name"] in (
                "rollout",
                "sandbox",
                "verifier",
                "learner",
                "engine",
            )


def test_committed_k8s_prometheus_manifest_equals_what_the_generator_writes(tmp_path):
    prometheus_config.write_generated(tmp_path / "prometheus", tmp_path / "k8s")
    assert (K8S_DIR / prometheus_config.K8S_FILE).read_text() == (
        tmp_path / "k8s" / prometheus_config.K8S_FILE
    ).read_text(), "run python -m cli.prometheus_config"
