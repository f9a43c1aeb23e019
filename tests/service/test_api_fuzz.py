"""The engine and the rollout gateway as real processes behind the stack's token, under hostile and
generated input (issue 17 items 8 and 10).

* Schemathesis generates schema-valid and schema-violating requests from each service's own
  OpenAPI document (a few per operation, deterministic) and checks that none is answered with a
  5xx and that every status is one the document lists. `make fuzz` (benchmarks/fuzz_apis.py) is
  the long run over all five services.
* The engine inputs that were 500s or stalls at 5456081 are each a 400 naming the field now.
* The engine and its client speak SGLang's `--api-key` header: `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, status_code_conformance

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port

TOKEN = "fuzz-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 4  # per operation and mode; deterministic (derandomized)
BLOCKING = ("/pause_generation", "/init_weights_update_group")  # tested by hand below


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    env = {"SHELLRL_MODEL_PATH": "tiny", "SHELLRL_NUM_THREADS": "1", "SHELLRL_API_TOKEN": TOKEN}
    proc = ServiceProcess("engine", free_port(), env, tmp_path_factory.mktemp("engine"))
    yield proc.start(ready_timeout_s=180)
    proc.stop()


@pytest.fixture(scope="module")
def gateway(engine, module_redis_server, tmp_path_factory):
    nowhere = "http://127.0.0.1:9"  # no sandbox or verifier: nothing here runs an episode
    env = {
        "SHELLRL_REDIS_URL": module_redis_server.url,
        "SHELLRL_ENGINE_URLS": engine.url,
        "SHELLRL_SANDBOX_URL": nowhere,
        "SHELLRL_VERIFIER_URL": nowhere,
        "SHELLRL_MODEL_PATH": "tiny",
        "SHELLRL_WORKER_ENABLED": "false",
        "SHELLRL_EVAL_MAX_IN_FLIGHT": "1",
        "SHELLRL_MAX_NEW_TOKENS": "2",
        "SHELLRL_API_TOKEN": TOKEN,
    }
    proc = ServiceProcess("rollout", free_port(), env, tmp_path_factory.mktemp("rollout"))
    yield proc.start(ready_timeout_s=120)
    proc.stop()


def _short_generations(case) -> None:
    """At most 2 new tokens per prompt (the tiny model on a loaded CPU): the parsers see the
    generated body otherwise unchanged."""
    if case.operation.path != "/generate" or not isinstance(case.body, dict):
        return
    params = case.body.get("sampling_params")
    for item in params if isinstance(params, list) else [params]:
        if isinstance(item, dict):
            tokens = item.get("max_new_tokens")
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens > 2:
                item["max_new_tokens"] = 2
    if params is None:
        case.body["sampling_params"] = {"max_new_tokens": 2}


def fuzz(url: str, exclude: tuple[str, ...] = ()) -> Counter:
    """Every operation of `url`'s document, EXAMPLES schema-valid and EXAMPLES schema-violating
    requests each; raises on a 5xx or an undocumented status. Returns the statuses seen."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH)
    statuses: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in exclude:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                _short_generations(case)
                case.headers = {**(case.headers or {}), **AUTH}  # not the generated bearer
                response = case.call(timeout=120)
                statuses[response.status_code] += 1
                case.validate_response(
                    response, checks=[not_a_server_error, status_code_conformance]
                )

            try:
                run()
            except Unsatisfiable:  # no way to violate an operation without parameters
                pass
    return statuses


def test_generated_requests_to_the_rollout_gateway_get_no_5xx_and_documented_statuses(gateway):
    statuses = fuzz(gateway.url)
    assert sum(statuses.values()) >= 60 and {201, 404, 422} <= set(statuses), statuses
    assert 401 not in statuses, statuses  # every generated request reached its route


def test_generated_requests_to_the_engine_get_no_5xx_and_documented_statuses(engine):
    statuses = fuzz(engine.url, exclude=BLOCKING)
    assert sum(statuses.values()) >= 150 and {200, 400} <= set(statuses), statuses
    assert 401 not in statuses, statuses


def _post(engine, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "content-type": "application/json"}
    return httpx.post(f"{engine.url}{path}", content=content, headers=headers, timeout=60, **kwargs)


SHORT = {"max_new_tokens": 2}
HOSTILE = [  # (path, raw body, the field the 400 names)
    ("/generate", b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    (
        "/generate",
        b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "stop": ["\\udfff"]}}',
        "sampling_params.stop[0]",
    ),
    ("/generate", b'{"input_ids": [1, 2], "rid": "a\\ud800"}', "rid"),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {**SHORT, "sampling_seed": 2**70}},
        "sampling_params.sampling_seed",
    ),
    ("/generate", b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("/generate", {"input_ids": [1], "return_sampling_mask": 0}, "return_sampling_mask"),
    ("/update_weight_version", {"new_version": "v" * 1_000_000}, "new_version"),
    ("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 10**12}, "truncate_size"),
    ("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": -5}, "truncate_size"),
    ("/abort_request", b'{"rid": "\\ud800"}', "rid"),
    ("/pause_generation", b"", "body"),
    ("/continue_generation", b"", "body"),
]


@pytest.mark.parametrize("path,body,field", HOSTILE, ids=[f"{p} {f}" for p, _, f in HOSTILE])
def test_a_hostile_engine_body_is_a_400_naming_the_field(engine, path, body, field):
    refused = _post(engine, path, body)
    assert refused.status_code == 400, refused.text[:500]
    assert refused.json()["error"]["field"] == field


def test_a_refused_pause_pauses_nothing_and_a_refused_version_is_not_served(engine):
    assert _post(engine, "/pause_generation", b"").status_code == 400
    answer = _post(engine, "/generate", {"input_ids": [1, 2], "sampling_params": SHORT})
    assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 2
    assert _post(engine, "/update_weight_version", {"new_version": "v" * 300}).status_code == 400
    info = httpx.get(f"{engine.url}/model_info", headers=AUTH, timeout=30).json()
    assert len(info["weight_version"]) < 300


async def test_the_engine_client_sends_the_token_as_sglang_api_key_header(engine):
    async with EngineClient([engine.url], api_token=TOKEN) as client:
        result = await client.generate([1, 2, 3], SHORT)
    assert len(result.output_ids) == 2
    async with EngineClient([engine.url], connect_retries=0) as anonymous:
        with pytest.raises(EngineError) as refused:
            await anonymous.generate([1, 2, 3], SHORT)
    assert refused.value.status == 401
    assert httpx.get(f"{engine.url}/health", timeout=30).status_code == 200  # probes stay open


TASK = {"instruction": "What is 2 + 2?", "check": {"type": "answer_equals", "expected": "4"}}
HOSTILE_TASKS = [  # (body of POST /v1/tasks, the field the 422 names)
    (
        {**TASK, "check": {"type": "file_contains", "path": "a", "substring": "x", "regex": "y"}},
        "check.regex",
    ),
    ([TASK, {**TASK, "check": {"type": {}}}], "tasks[1].check.type"),
    (
        {**TASK, "check": {"type": "answer_integer_equals", "expected": -(2**63) - 1}},
        "check.expected",
    ),
    ({**TASK, "tags": ["\ud800"]}, None),  # refused by the JSON reader: not valid Unicode
    ({**TASK, "max_turns": {}}, "max_turns"),
]


@pytest.mark.parametrize("body,field", HOSTILE_TASKS, ids=[str(f) for _, f in HOSTILE_TASKS])
def test_a_hostile_task_is_a_422_naming_the_field(gateway, body, field):
    content = json.dumps(body).encode()  # json.dumps escapes a lone surrogate as \ud800
    headers = {**AUTH, "content-type": "application/json"}
    refused = httpx.post(f"{gateway.url}/v1/tasks", content=content, headers=headers, timeout=60)
    assert refused.status_code == 422, refused.text[:500]
    assert refused.json()["error"]["field"] == field
