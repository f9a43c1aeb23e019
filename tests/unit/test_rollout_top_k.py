"""top_k: SGLang accepts -1 (disabled) or >= 1 and refuses 0 (sampling_params.py verify); the
gateway refused nothing, so a task evaluated with top_k 0 failed at every generate."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from services.rollout.episode_spec import Sampling
from services.rollout.settings import RolloutSettings
from shellrl.service.app import create_app


@pytest.mark.parametrize("top_k", [0, -2])
def test_top_k_zero_or_below_minus_one_is_refused_in_requests_and_settings(top_k):
    with pytest.raises(ValidationError, match="top_k"):
        Sampling(top_k=top_k)
    with pytest.raises(ValidationError, match="top_k"):
        RolloutSettings(top_k=top_k)


def test_top_k_zero_names_sglangs_rule():
    with pytest.raises(ValidationError, match="top_k must be -1 \\(disabled\\) or >= 1"):
        Sampling(top_k=0)


@pytest.mark.parametrize("top_k", [-1, 1, 40])
def test_top_k_minus_one_or_positive_passes(top_k):
    assert Sampling(top_k=top_k).top_k == top_k == RolloutSettings(top_k=top_k).top_k


async def test_a_request_with_top_k_zero_gets_a_4xx_naming_the_field():
    app = create_app("demo", {})

    @app.post("/v1/sample")
    async def sample(body: Sampling) -> dict:
        return {"top_k": body.top_k}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as client:
        response = await client.post("/v1/sample", json={"top_k": 0})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "top_k"
