"""deploy/k8s manifests: schema-valid for Kubernetes (kubernetes-validate, strict: unknown fields
fail) and shaped as the design says (replicated stages; the data-parallel learner as StatefulSets
running torchrun, node rank 0 the rendezvous and the service, checkpoints on a shared volume;
engines as a Deployment whose pods register themselves; Redis with AOF on a volume, probes on
/healthz and /readyz, settings from one ConfigMap). test_deploy_launch.py runs their commands."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize(
    "workload,path,typo",
    [
        ("learner-worker", ["spec", "ordinals"], {"begin": 1}),
        (
            "engine",
            ["spec", "template", "spec", "containers", 0, "lifecycle", "preStop"],
            {"slep": {"seconds": 5}},
        ),
    ],
    ids=["statefulset-ordinals", "prestop-sleep"],
)
def test_the_validator_knows_the_newer_fields_the_manifests_use(workload, path, typo):
    """The start ordinal and the sleep preStop action are checked, not passed through: a typo in
    them fails (Kubernetes 1.33's schema has them)."""
    broken = yaml.safe_load(yaml.safe_dump(workloads()[workload]))
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = typo
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


def env_values(main: dict) -> dict[str, str | None]:
    """A container's `env` as name -> value (None for a valueFrom)."""
    return {e["name"]: e.get("value") for e in main.get("env", [])}


def flag_values(args: list[str]) -> dict[str, str]:
    """--flag=value arguments as {"--flag": "value"}."""
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def expanded(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args from the container's environment."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value)


def test_learner_pods_share_the_checkpoint_volume_and_have_a_gpu():
    """Every rank writes its torch.distributed.checkpoint shards into one directory, so every
    learner pod mounts the same ReadWriteMany claim there."""
    found = workloads()
    claims = {
        d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == "PersistentVolumeClaim"
    }
    for name in ("learner", "learner-worker"):
        learner = found[name]
        assert learner["kind"] == "StatefulSet" and "volumeClaimTemplates" not in learner["spec"]
        volumes = {v["name"]: v for v in learner["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container(learner)["volumeMounts"]}
        claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], name
        assert mounts["checkpoints"] == env_values(container(learner))["SHELLRL_CHECKPOINT_DIR"]
        assert container(learner)["resources"]["limits"]["nvidia.com/gpu"] == "1", name
    assert found["learner"]["spec"]["replicas"] == 1


def test_learner_runs_torchrun_with_its_rendezvous_on_node_rank_0():
    """One torchrun per pod: node rank = the StatefulSet ordinal (learner-0 is node 0, whose rank
    0 is the service; learner-worker ordinals start at 1), --nnodes = all learner pods,
    --nproc-per-node = the pod's GPUs, the rendezvous at learner-0 through its headless Service,
    resolvable before any pod is ready."""
    found = workloads()
    leader, workers = found["learner"], found["learner-worker"]
    nodes = leader["spec"]["replicas"] + workers["spec"]["replicas"]
    assert workers["spec"]["ordinals"] == {"start": leader["spec"]["replicas"]}
    service = next(
        d for _, d in manifests() if d["kind"] == "Service" and d["metadata"]["name"] == "learner"
    )
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    rendezvous = next(p for p in service["spec"]["ports"] if p["name"] == "rendezvous")
    for workload in (leader, workers):
        main = container(workload)
        env = {k: v for k, v in env_values(main).items() if v is not None}
        assert main["command"] == ["torchrun"] and main["args"][-2:] == ["-m", "services.learner"]
        flags = {k: expanded(v, env) for k, v in flag_values(main["args"]).items()}
        assert int(flags["--nnodes"]) == nodes
        assert flags["--nproc-per-node"] == main["resources"]["limits"]["nvidia.com/gpu"]
        assert (
            flags["--master-addr"]
            == f"{leader['metadata']['name']}-0.{service['metadata']['name']}"
        )
        assert int(flags["--master-port"]) == rendezvous["port"]
        assert int(flags["--max-restarts"]) >= 1
        [node_rank] = [e for e in main["env"] if e["name"] == "LEARNER_NODE_RANK"]
        assert node_rank["valueFrom"] == {
            "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
        }
        assert flags["--node-rank"] == "$(LEARNER_NODE_RANK)"
    assert {"name": "rendezvous", "containerPort": rendezvous["port"]} in container(leader)["ports"]
    # the followers build the same trainer: the same image, settings and mounts as rank 0's pod
    for key in ("image", "command", "args", "envFrom", "env", "resources", "volumeMounts"):
        assert container(workers)[key] == container(leader)[key], key
    assert (
        workers["spec"]["template"]["spec"]["volumes"]
        == (leader["spec"]["template"]["spec"]["volumes"])
    )


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
        if name == "learner":  # torchrun ... -m services.learner (one process per GPU)
            assert main["command"] == ["torchrun"], name
            assert main["args"][-2:] == ["-m", "services.learner"], name
        else:
            assert main["command"] == ["python", "-m", f"services.{name}"], name
        assert main["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert main["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert main["ports"][0] == {"name": "http", "containerPort": port}, name
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
            for p in c.get("ports", [])
        }
        assert {p["targetPort"] for p in doc["spec"].get("ports", [])} <= port_names, doc[
            "metadata"
        ]["name"]
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


def test_engines_are_a_deployment_of_sglang_whose_pods_register_their_own_address():
    """No engine address is configured: each engine pod's registration sidecar advertises
    http://<pod IP>:<SGLang's port> (downward API) in the Redis every service uses."""
    engine = workloads()["engine"]
    sglang, sidecar = engine["spec"]["template"]["spec"]["containers"]
    assert engine["kind"] == "Deployment" and engine["spec"]["replicas"] >= 2
    assert sglang["image"].startswith("lmsysorg/sglang:")
    assert "--base-gpu-id" in sglang["args"] and "--mem-fraction-static" in sglang["args"]
    assert sglang["readinessProbe"]["httpGet"]["path"] == "/health"
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == "1"
    configmap = next(doc for _, doc in manifests() if doc["kind"] == "ConfigMap")["data"]
    assert configmap["SHELLRL_ENGINE_URLS"] == ""  # registered engines only
    assert configmap["SHELLRL_REDIS_URL"] == "redis://redis-0.redis:6379/0"
    assert sidecar["command"] == ["python", "-m", "services.engine.registration"]
    assert sidecar["image"] == container(workloads()["rollout"])["image"]  # shellrl's CPU image
    env = {e["name"]: e["valueFrom"] for e in sidecar["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    flags = dict(zip(sidecar["args"][::2], sidecar["args"][1::2]))
    [port] = sglang["ports"]
    assert flags["--engine-url"] == f"http://$(POD_IP):{port['containerPort']}"
    assert flags["--model-path"] == "$(SHELLRL_MODEL_PATH)" == sglang["args"][1]
    for name in ("SHELLRL_MODEL_PATH", "SHELLRL_REDIS_URL"):
        assert env[name] == {"configMapKeyRef": {"name": "shellrl-settings", "key": name}}
    assert flags["--redis-url"] == "$(SHELLRL_REDIS_URL)"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in sidecar["volumeMounts"]
    # a leaving pod: the sidecar withdraws the registration at SIGTERM while SGLang serves on
    assert sglang["lifecycle"]["preStop"]["sleep"]["seconds"] >= 2


def test_rollout_pods_read_task_files_from_the_generated_configmap():
    """POST /v1/runs {"task_file": ...} (issue 22 item 3): the ConfigMap that kustomization.yaml
    generates from tasks/ is mounted read-only at the gateway's SHELLRL_TASK_FILE_DIR, and every
    file it holds is a valid train set that fits in a ConfigMap."""
    from services.rollout.run_routes import read_task_file

    rollout = workloads()["rollout"]
    env = {e["name"]: e.get("value") for e in container(rollout)["env"]}
    mounts = {m["name"]: m for m in container(rollout)["volumeMounts"]}
    volumes = {v["name"]: v for v in rollout["spec"]["template"]["spec"]["volumes"]}
    assert mounts["tasks"] == {
        "name": "tasks",
        "mountPath": env["SHELLRL_TASK_FILE_DIR"],
        "readOnly": True,
    }
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    [generated] = [g for g in kustomization["configMapGenerator"] if g["name"] == "shellrl-tasks"]
    assert volumes["tasks"]["configMap"]["name"] == generated["name"]
    shipped = {p.relative_to(K8S_DIR).as_posix() for p in (K8S_DIR / "tasks").glob("*.jsonl")}
    assert set(generated["files"]) == shipped and shipped
    assert sum((K8S_DIR / f).stat().st_size for f in shipped) < 1 << 20
    for name in shipped:
        assert read_task_file(str(K8S_DIR), name), name
