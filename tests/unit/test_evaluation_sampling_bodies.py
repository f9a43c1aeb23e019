"""POST /v1/evaluations' `sampling` (issue 31: one sampling-parameters type from the API to the
episode, `services.rollout.episode_spec.Sampling`, where `SamplingIn` and `Sampling` were two).
The same bodies get the same answers as before the merge (`evaluation_sampling_bodies.json`,
captured with the two classes): the sampling an evaluation runs with (greedy, the body's, the
gateway's max_new_tokens when the body gives none) and every 422 body (field, message, details),
and the body's `sampling` has the same JSON Schema in /openapi.json (the component's name, title
and description, which is the class's docstring, aside).
The route under test is the real one's body model and sampling resolution on the services' app
factory (`create_app`), so no Redis or task store is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.rollout.evaluation_routes import _evaluation_sampling
from services.rollout.schemas import EvaluationIn
from shellrl.service.app import create_app

GOLDEN = json.loads(Path(__file__).with_name("evaluation_sampling_bodies.json").read_text())
GATEWAY_MAX_NEW_TOKENS = 40
SCHEMA_DOC = ("title", "description")


def _app():
    app = create_app("demo", {})

    @app.post("/v1/evaluations")
    async def start(body: EvaluationIn) -> dict:
        return {"sampling": _evaluation_sampling(body, GATEWAY_MAX_NEW_TOKENS).model_dump()}

    return app


async def _post_all(bodies: list) -> tuple[list, dict]:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as client:
        answers = []
        for body in bodies:
            response = await client.post("/v1/evaluations", json=body)
            answers.append([body, response.status_code, response.json()])
        spec = (await client.get("/openapi.json")).json()
    return answers, spec


@pytest.mark.parametrize("index", range(len(GOLDEN["answers"])))
async def test_each_body_gets_the_answer_it_got_before_the_merge(index):
    body, status, expected = GOLDEN["answers"][index]
    (answer,), _ = await _post_all([body])
    assert answer == [body, status, expected]


async def test_the_bodys_sampling_has_the_schema_it_had_before_the_merge():
    _, spec = await _post_all([])
    schemas = spec["components"]["schemas"]
    ref = schemas["EvaluationIn"]["properties"]["sampling"]["anyOf"][0]["$ref"]
    sampling = {k: v for k, v in schemas[ref.rsplit("/", 1)[1]].items() if k not in SCHEMA_DOC}
    assert sampling == GOLDEN["sampling_schema"]
