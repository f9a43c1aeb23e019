"""The committed Prometheus files of shellrl, generated: one scrape job per service, `job` = the
service name (cli/prometheus_scrape.py renders them).

It writes the compose file's config (targets are compose service names) and the local config
for the no-Docker stack (`shellrl up`: every service on 127.0.0.1); `k8s_manifest` writes
deploy/k8s/prometheus.yaml (a Prometheus that discovers the annotated shellrl pods). Every
deployed config loads the alert rules `deploy/prometheus/alerts.yml` (written by hand, unit-tested
by alerts.test.yml). The committed files are generated, never edited by hand; a test fails when
they are stale:

    python -m cli.prometheus_config   # rewrites deploy/prometheus/*.yml, deploy/k8s/prometheus.yaml

Dashboards (deploy/grafana/dashboards.py) select series by metric name only, so the job names
are free to differ, but keeping `job` = service name makes `sum by (job)` legends readable.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from cli.prometheus_scrape import config, generated_header, render

SERVICES = ("rollout", "sandbox", "verifier", "learner", "engine")
DEFAULT_PORTS = {
    "rollout": 8100,
    "sandbox": 8101,
    "verifier": 8102,
    "learner": 8103,
    "engine": 30000,
}
COMPOSE_TARGETS = {name: [f"{name}:{port}"] for name, port in DEFAULT_PORTS.items()}
LOCAL_TARGETS = {name: [f"127.0.0.1:{port}"] for name, port in DEFAULT_PORTS.items()}

DEPLOY_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
K8S_DIR = DEPLOY_DIR.parent / "k8s"
RULES_FILE = "alerts.yml"  # next to each config (compose mounts it there; k8s: the same ConfigMap)
GENERATED_FILES = {
    "prometheus.yml": dict(
        targets=COMPOSE_TARGETS,
        scrape_interval_s=5,
        self_target="localhost:9090",
        dns=True,
        rule_files=(RULES_FILE,),
        comment="docker-compose.yml: every replica of each compose service, by DNS.",
    ),
    "prometheus.local.yml": dict(
        targets=LOCAL_TARGETS,
        scrape_interval_s=5,
        self_target=None,
        rule_files=(RULES_FILE,),
        comment="the no-Docker stack (`shellrl up`) on its default ports.",
    ),
}
K8S_FILE = "prometheus.yaml"
K8S_NAMESPACE = "shellrl"
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.4"  # as docker-compose.yml


def k8s_config(namespace: str = K8S_NAMESPACE, scrape_interval_s: float = 5.0) -> dict:
    """Prometheus config for Kubernetes: every pod of `namespace` annotated `prometheus.io/scrape:
    "true"` is scraped on its `prometheus.io/port` and `prometheus.io/path`, with `job` = the pod's
    `app.kubernetes.io/name` label (the service name, as in compose) and `pod` = its name."""
    out = config({}, scrape_interval_s, self_target="localhost:9090", rule_files=(RULES_FILE,))
    annotation = "__meta_kubernetes_pod_annotation_prometheus_io_"
    out["scrape_configs"].insert(
        0,
        {
            "job_name": "shellrl-pods",
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [namespace]}}],
            "relabel_configs": [
                {"source_labels": [f"{annotation}scrape"], "action": "keep", "regex": "true"},
                {
                    "source_labels": ["__address__", f"{annotation}port"],
                    "action": "replace",
                    "regex": r"([^:]+)(?::\d+)?;(\d+)",
                    "replacement": "$1:$2",
                    "target_label": "__address__",
                },
                {
                    "source_labels": [f"{annotation}path"],
                    "action": "replace",
                    "regex": "(.+)",
                    "target_label": "__metrics_path__",
                },
                {
                    "source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
                    "target_label": "job",
                },
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        },
    )
    return out


def k8s_manifest(rules_text: str, namespace: str = K8S_NAMESPACE) -> str:
    """deploy/k8s/prometheus.yaml: a ServiceAccount allowed to list the namespace's pods, a
    ConfigMap with prometheus.yml (k8s_config) and alerts.yml (`rules_text`), a Deployment of
    Prometheus mounting both in /etc/prometheus, and its Service."""
    labels = {"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/part-of": "shellrl"}
    meta = {"name": "prometheus", "namespace": namespace, "labels": labels}
    prometheus_yml = generated_header("Kubernetes (deploy/k8s/prometheus.yaml).") + yaml.safe_dump(
        k8s_config(namespace), sort_keys=False
    )
    docs = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta,
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "prometheus",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": namespace}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {"prometheus.yml": prometheus_yml, RULES_FILE: rules_text},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "selector": {"app.kubernetes.io/name": "prometheus"},
                "ports": [{"name": "http", "port": 9090, "targetPort": "http"}],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "prometheus",
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 65534,
                            "fsGroup": 65534,
                        },
                        "containers": [
                            {
                                "name": "prometheus",
                                "image": PROMETHEUS_IMAGE,
                                "args": [
                                    "--config.file=/etc/prometheus/prometheus.yml",
                                    "--storage.tsdb.path=/prometheus",
                                    "--storage.tsdb.retention.time=15d",
                                ],
                                "ports": [{"name": "http", "containerPort": 9090}],
                                "readinessProbe": {
                                    "httpGet": {"path": "/-/ready", "port": "http"},
                                    "periodSeconds": 10,
                                },
                                "livenessProbe": {
                                    "httpGet": {"path": "/-/healthy", "port": "http"},
                                    "periodSeconds": 15,
                                },
                                "volumeMounts": [
                                    {
                                        "name": "config",
                                        "mountPath": "/etc/prometheus",
                                        "readOnly": True,
                                    },
                                    {"name": "data", "mountPath": "/prometheus"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": "prometheus"}},
                            {"name": "data", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
    ]
    header = (
        "# Generated by `python -m cli.prometheus_config`; do not edit by hand.\n"
        "# Prometheus for the shellrl namespace: scrapes the pods annotated\n"
        f"# prometheus.io/scrape and evaluates deploy/prometheus/{RULES_FILE} (embedded\n"
        "# below).\n"
        "# Data on an emptyDir: point remote_write or a PersistentVolumeClaim at it to keep\n"
        "# history across restarts.\n"
    )
    texts = [yaml.dump(d, Dumper=_BlockDumper, sort_keys=False, width=120) for d in docs]
    return header + "---\n".join(texts)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the embedded files) as readable `|` blocks."""


_BlockDumper.add_representer(
    str,
    lambda dumper, value: dumper.represent_scalar(
        "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None
    ),
)


def write_generated(directory: Path = DEPLOY_DIR, k8s_directory: Path | None = None) -> list[Path]:
    """Writes every file of GENERATED_FILES into `directory`, and K8S_FILE (with the rules of
    DEPLOY_DIR/alerts.yml) into `k8s_directory` when given; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, kwargs in GENERATED_FILES.items():
        path = directory / name
        path.write_text(render(**kwargs))
        paths.append(path)
    if k8s_directory is not None:
        k8s_directory.mkdir(parents=True, exist_ok=True)
        path = k8s_directory / K8S_FILE
        path.write_text(k8s_manifest((DEPLOY_DIR / RULES_FILE).read_text()))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEPLOY_DIR, help="directory to write into")
    parser.add_argument(
        "--k8s-out", type=Path, default=K8S_DIR, help=f"directory to write {K8S_FILE} into"
    )
    args = parser.parse_args(argv)
    for path in write_generated(args.out, args.k8s_out):
        print(path)


if __name__ == "__main__":
    main()
