"""deploy/k8s manifests: schema-valid for Kubernetes (kubernetes-validate, strict: unknown fields
fail) and shaped as the design says (replicated stages, learner StatefulSet with its checkpoint
volume, Redis with AOF on a volume, probes on /healthz and /readyz, settings from one ConfigMap)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = (
    "1.33.0"  # the oldest release with user namespaces and ProcMountType on by default
)
SHELLRL_SERVICES = {"rollout": 8100, "sandbox": 8101, "verifier": 8102, "learner": 8103}


def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def workloads() -> dict[str, dict]:
    return {
        doc["metadata"]["name"]: doc
        for _, doc in manifests()
        if doc["kind"] in ("Deployment", "StatefulSet")
    }


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "name,doc", manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"]
)
def test_manifest_is_valid_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_an_unknown_field():
    doc = workloads()["rollout"]
    broken = yaml.safe_load(yaml.safe_dump(doc))
    container(broken)["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_stages_scale_out_by_replicas():
    found = workloads()
    for stage in ("sandbox", "verifier"):
        assert found[stage]["kind"] == "Deployment" and found[stage]["spec"]["replicas"] >= 1, stage
    assert found["rollout"]["spec"]["replicas"] >= 2 and found["verifier"]["spec"]["replicas"] >= 2


def test_rollout_replicas_keep_their_consumer_name_across_restarts():
    """Admission gives back a replica's in-flight slots when a replica of the same name starts, so
    rollout pods need stable names (StatefulSet) and use them as SHELLRL_CONSUMER_NAME."""
    rollout = workloads()["rollout"]
    assert rollout["kind"] == "StatefulSet"
    [name] = [e for e in container(rollout)["env"] if e["name"] == "SHELLRL_CONSUMER_NAME"]
    assert name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_learner_is_a_statefulset_with_its_checkpoint_volume_and_a_gpu():
    learner = workloads()["learner"]
    assert learner["kind"] == "StatefulSet" and learner["spec"]["replicas"] == 1
    [claim] = learner["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container(learner)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/var/lib/shellrl/checkpoints"
    env = {e["name"]: e.get("value") for e in container(learner)["env"]}
    assert env["SHELLRL_CHECKPOINT_DIR"] == "/var/lib/shellrl/checkpoints"
    assert container(learner)["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_redis_is_a_statefulset_with_aof_on_its_own_volume():
    redis = workloads()["redis"]
    assert redis["kind"] == "StatefulSet"
    args = container(redis)["args"]
    assert (
        args[args.index("--appendonly") + 1] == "yes" and args[args.index("--dir") + 1] == "/data"
    )
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert {m["name"]: m["mountPath"] for m in container(redis)["volumeMounts"]} == {
        claim["metadata"]["name"]: "/data"
    }


def test_shellrl_services_probe_healthz_and_readyz_and_read_the_settings_configmap():
    found = workloads()
    configmap = next(doc for _, doc in manifests() if doc["kind"] == "ConfigMap")
    for name, port in SHELLRL_SERVICES.items():
        main = container(found[name])
        assert main["command"] == ["python", "-m", f"services.{name}"]
        assert main["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert main["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert main["ports"] == [{"name": "http", "containerPort": port}], name
        assert main["envFrom"] == [{"configMapRef": {"name": configmap["metadata"]["name"]}}], name
        assert {"name": "SHELLRL_PORT", "value": str(port)} in main["env"], name
        annotations = found[name]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port), name


def test_every_service_selector_matches_a_workload_and_named_port():
    found = workloads()
    for _, doc in manifests():
        if doc["kind"] != "Service":
            continue
        selector = doc["spec"]["selector"]
        [workload] = [
            w
            for w in found.values()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        port_names = {
            p["name"]
            for c in workload["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        assert {p["targetPort"] for p in doc["spec"]["ports"]} <= port_names, doc["metadata"][
            "name"
        ]
        if workload["kind"] == "StatefulSet":
            assert workload["spec"]["serviceName"] == doc["metadata"]["name"]


def test_sandbox_pod_gets_what_bubblewrap_needs_inside_its_own_user_namespace():
    pod = workloads()["sandbox"]["spec"]["template"]["spec"]
    assert pod["hostUsers"] is False and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {
        "seccompProfile": {"type": "Unconfined"},
        "appArmorProfile": {"type": "Unconfined"},
    }
    security = pod["containers"][0]["securityContext"]
    assert security == {"procMount": "Unmasked", "capabilities": {"add": ["SYS_ADMIN"]}}


def test_engines_are_sglang_on_a_gpu_each_with_stable_addresses_in_the_settings():
    engine = workloads()["engine"]
    main = container(engine)
    assert engine["kind"] == "StatefulSet" and main["image"].startswith("lmsysorg/sglang:")
    assert "--base-gpu-id" in main["args"] and "--mem-fraction-static" in main["args"]
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
    configmap = next(doc for _, doc in manifests() if doc["kind"] == "ConfigMap")["data"]
    assert configmap["SHELLRL_ENGINE_URLS"] == "http://engine-0.engine:30000"
    assert configmap["SHELLRL_REDIS_URL"] == "redis://redis-0.redis:6379/0"
