"""The rollout gateway's JSON success answers (issue 34 item 7): a real gateway process (worker off,
no engine, sandbox or verifier reachable, bearer token on) over real Redis holding a task, a
finished trajectory, an evaluation (its one episode ends as an infra failure: no engine) and a
training run, asked every JSON route.

* Each body equals the one captured before the routes had response models
  (`gateway_bodies.json`), after the values that change from run to run (timestamps, generated
  ids, ports) are replaced by their JSON type: the same keys, the same values, the same JSON
  types (1 and 1.0 differ). A route's response model must not add, drop or rename a key.
  `SHELLRL_WRITE_GATEWAY_BODIES=1` writes the file again (only for a deliberate body change).
* Every JSON route's success answer has a non-empty schema in /openapi.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from services.rollout.prompt import ChatFormat
from shellrl.streams import STREAM_TRAJECTORIES
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until
from tests.service.rollout.test_transcripts import publish, trajectory

TOKEN = "gateway-bodies-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOWHERE = "http://127.0.0.1:9"  # nothing listens: the evaluation's episode fails as infra
GOLDEN = Path(__file__).with_name("gateway_bodies.json")
VOLATILE = {
    "created_at",
    "finished_at",
    "uptime_s",
    "elapsed_s",
    "failure_detail",
    "why_not",
    "port",
    "entry_id",
}
TASK = {
    "task_id": "bodies-task",
    "instruction": "How many lines does numbers.txt have?",
    "setup": "seq 1 5 > numbers.txt",
    "check": {"type": "answer_integer_equals", "expected": 5},
    "split": "eval_id",
    "tags": ["lines"],
    "source": "bodies",
}
TRAIN_TASK = {**TASK, "task_id": "bodies-train", "split": "train"}


@pytest.fixture(scope="module")
def gateway(module_redis_server, tmp_path_factory):
    proc = ServiceProcess(
        "rollout",
        free_port(),
        {
            "SHELLRL_REDIS_URL": module_redis_server.url,
            "SHELLRL_API_TOKEN": TOKEN,
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_WORKER_ENABLED": "false",
            "SHELLRL_ENGINE_URLS": NOWHERE,
            "SHELLRL_SANDBOX_URL": NOWHERE,
            "SHELLRL_VERIFIER_URL": NOWHERE,
            "SHELLRL_MAX_NEW_TOKENS": "2",
        },
        tmp_path_factory.mktemp("gateway-bodies-logs"),
    ).start(120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def answered(gateway, module_redis_server, chat) -> dict[str, tuple[int, object]]:
    return answers(gateway, module_redis_server.url, chat)


def call(gateway, method: str, path: str, body=None) -> httpx.Response:
    return httpx.request(method, f"{gateway.url}{path}", json=body, headers=AUTH, timeout=60)


def answers(gateway, redis_url: str, chat: ChatFormat) -> dict[str, tuple[int, object]]:
    """{"METHOD path": (status, body)} of every JSON success route, in an order that fills the
    state the later ones read."""
    out: dict[str, tuple[int, object]] = {}

    def ask(method: str, path: str, body=None, key: str | None = None) -> object:
        r = call(gateway, method, path, body)
        assert r.status_code < 300, (path, r.status_code, r.text)
        out[key or f"{method} {path}"] = (r.status_code, r.json())
        return r.json()

    for path in ("/healthz", "/readyz", "/v1/config"):
        ask("GET", path)
    ask("POST", "/v1/tasks", TASK)
    ask("POST", "/v1/tasks", [TASK, {**TASK, "task_id": "bodies-task-2"}], key="POST /v1/tasks []")
    ask("GET", "/v1/tasks/bodies-task")
    ask("GET", "/v1/tasks?limit=1")
    ask("GET", "/v1/tasks?split=eval_id&limit=5", key="GET /v1/tasks?split")
    traj = trajectory(chat, "bodies-traj")
    traj.task_id = "bodies-task"
    publish(redis_url, STREAM_TRAJECTORIES, traj)
    ask("GET", "/v1/trajectories/bodies-traj")
    ask("GET", "/v1/trajectories?task_id=bodies-task")
    started = ask("POST", "/v1/evaluations", {"task_ids": ["bodies-task"]})
    path = f"/v1/evaluations/{started['evaluation_id']}"
    wait_until(
        lambda: call(gateway, "GET", path).json()["state"] != "running", 120, "the evaluation"
    )
    ask("GET", path, key="GET /v1/evaluations/{evaluation_id}")
    ask("GET", "/v1/evaluations")
    run = ask("POST", "/v1/runs", {"tasks": [TRAIN_TASK], "steps": 2, "name": "bodies"})
    ask("GET", f"/v1/runs/{run['run_id']}", key="GET /v1/runs/{run_id}")
    ask("GET", "/v1/runs")
    ask("POST", f"/v1/runs/{run['run_id']}/stop", key="POST /v1/runs/{run_id}/stop")
    ask("GET", "/v1/status")
    return out


def normalized(value, replace: dict[str, str], key: str | None = None):
    """`value` with run-to-run values replaced: a VOLATILE key's value by its JSON type
    (`<float>`, `<null>`...), and every substring in `replace` by its placeholder; int and float
    stay apart (`<int>` vs `<float>` where replaced, and 1 vs 1.0 elsewhere through `typed`)."""
    if key in VOLATILE:
        return f"<{type(value).__name__ if value is not None else 'null'}>"
    if isinstance(value, dict):
        return {_swap(k, replace): normalized(v, replace, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalized(v, replace) for v in value]
    if isinstance(value, str):
        return _swap(value, replace)
    return typed(value)


def typed(value):
    """A JSON scalar with its type kept through json.dumps/loads and ==: floats as {"float": x}."""
    return {"<float>": value} if isinstance(value, float) else value


def _swap(text: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


def test_every_json_answer_keeps_its_keys_values_and_types(gateway, module_redis_server, answered):
    got = answered
    evaluation_id = got["POST /v1/evaluations"][1]["evaluation_id"]
    run_id = got["POST /v1/runs"][1]["run_id"]
    replace = {
        evaluation_id: "<evaluation_id>",
        run_id: "<run_id>",
        module_redis_server.url: "<redis_url>",
        str(gateway.port): "<port>",
    }
    bodies = {k: [status, normalized(body, replace)] for k, (status, body) in got.items()}
    if os.environ.get("SHELLRL_WRITE_GATEWAY_BODIES") == "1":
        GOLDEN.write_text(json.dumps(bodies, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert sorted(bodies) == sorted(expected)
    for route, answer in expected.items():
        assert bodies[route] == answer, route


def undocumented(body, schema: dict, schemas: dict, where: str = "") -> list[str]:
    """Paths of the keys in `body` that `schema` (an OpenAPI schema; `schemas` its components)
    does not name: a dict's keys must be `properties`, unless the schema is a map
    (`additionalProperties` only) or says nothing (any value)."""
    while "$ref" in schema:
        schema = schemas[schema["$ref"].rsplit("/", 1)[-1]]
    if "anyOf" in schema:  # `X | None`: the branch for the value's kind
        branches = [b for b in schema["anyOf"] if b.get("type") != "null"]
        if body is None or not branches:
            return []
        return min((undocumented(body, b, schemas, where) for b in branches), key=len, default=[])
    if isinstance(body, list):
        return [m for v in body for m in undocumented(v, schema.get("items", {}), schemas, where)]
    if not isinstance(body, dict):
        return []
    props = schema.get("properties")
    if props is None:
        values = schema.get("additionalProperties")
        if not isinstance(values, dict):
            return []
        return [
            m for k, v in body.items() for m in undocumented(v, values, schemas, f"{where}.{k}")
        ]
    missing = [f"{where}.{k}" for k in body if k not in props]
    for k, v in body.items():
        if k in props:
            missing += undocumented(v, props[k], schemas, f"{where}.{k}")
    return missing


def test_every_key_answered_is_documented(gateway, answered):
    doc = call(gateway, "GET", "/openapi.json").json()
    templates = {
        "GET /v1/tasks?limit=1": "GET /v1/tasks",
        "GET /v1/tasks?split": "GET /v1/tasks",
        "POST /v1/tasks []": "POST /v1/tasks",
        "GET /v1/tasks/bodies-task": "GET /v1/tasks/{task_id}",
        "GET /v1/trajectories/bodies-traj": "GET /v1/trajectories/{trajectory_id}",
        "GET /v1/trajectories?task_id=bodies-task": "GET /v1/trajectories",
    }
    missing = {}
    for route, (status, body) in answered.items():
        if route == "GET /readyz":  # besides these, each service's own details
            body = {k: body[k] for k in ("ready", "service")}
        method, path = templates.get(route, route).split(" ")
        responses = doc["paths"][path][method.lower()]["responses"]
        schema = responses[str(status)]["content"]["application/json"]["schema"]
        if gaps := undocumented(body, schema, doc["components"]["schemas"]):
            missing[route] = gaps
    assert not missing, missing


def test_every_json_route_documents_a_non_empty_success_schema(gateway):
    doc = call(gateway, "GET", "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    documented = []
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            success = {s: r for s, r in operation["responses"].items() if s.startswith("2")}
            assert success, (method, path)
            for status, response in success.items():
                content = response.get("content", {})
                if "application/json" not in content:
                    assert path == "/metrics", (method, path, status)  # Prometheus text
                    continue
                schema = content["application/json"].get("schema", {})
                if "$ref" in schema:
                    schema = schemas[schema["$ref"].rsplit("/", 1)[-1]]
                assert schema.get("properties") or schema.get("oneOf"), (method, path, status)
                documented.append(f"{method.upper()} {path}")
    assert len(documented) >= 16, documented
