"""SGLang's `sampling_params` of a `/generate` request (sampling/sampling_params.py) and its
validation: unknown keys are rejected, as SGLang 0.5.23 does; fields this engine does not implement
are accepted only with their default value. Errors are `ApiError(400)` naming the field
(`sampling_params[1].top_k`).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from shellrl.service.app import ApiError

MAX_STOP_STRINGS = 32


# Named apart from the trajectory's proto message shellrl.v1.SamplingParams (shellrl.contract);
# its schema keeps SGLang's title, SamplingParams.
class SglangSamplingParams(BaseModel):
    """SGLang's `sampling_params` (sampling/sampling_params.py); unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", title="SamplingParams")

    max_new_tokens: StrictInt | None = Field(128, ge=0)  # None: up to the context length
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    no_stop_trim: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    # SGLang's bound (sampling_params.py:verify); past it torch's generator overflowed (a 500)
    sampling_seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream_interval: StrictInt | None = None
    custom_params: dict | None = None
    # Accepted only at their defaults (checked in `parse_sampling_params`).
    n: StrictInt = 1
    min_new_tokens: StrictInt = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    beam_width: StrictInt | None = None
    watermark: dict | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (one string is one stop string)."""
        return tuple([self.stop] if isinstance(self.stop, str) else self.stop or [])

    def stop_regexes(self) -> tuple[str, ...]:
        """`stop_regex` as a tuple (one string is one pattern)."""
        return tuple(
            [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex or []
        )


_UNSUPPORTED_SAMPLING = {
    "n": 1,
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "beam_width": None,
    "watermark": None,
}


def parse_sampling_params(raw: dict, field: str, vocab_size: int) -> SglangSamplingParams:
    """`raw` (one request's `sampling_params`) validated; `field` names it in errors. Raises
    ApiError(400): a bad or unsupported value, more than MAX_STOP_STRINGS or empty stop strings, a
    stop_regex that does not compile, stop_token_ids outside [0, vocab_size)."""
    try:
        # An explicit null means "the default", except for max_new_tokens, where SGLang reads null as
        # "no limit" (scheduler.py:init_req_max_new_tokens), i.e. up to the context length.
        params = SglangSamplingParams.model_validate(
            {k: v for k, v in raw.items() if v is not None or k == "max_new_tokens"}
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise ApiError(
            400, "invalid_request", f"{field}.{where}: {error['msg']}", f"{field}.{where}"
        ) from exc
    if params.logit_bias == {}:  # SGLang's own default (entrypoints/openai/protocol.py)
        params.logit_bias = None
    for key, default in _UNSUPPORTED_SAMPLING.items():
        if getattr(params, key) != default:
            raise ApiError(
                400, "unsupported", f"{key} is not supported by shellrl's engine", f"{field}.{key}"
            )
    if params.top_k == 0 or params.top_k < -1:
        raise ApiError(
            400, "invalid_request", "top_k must be -1 (disabled) or >= 1", f"{field}.top_k"
        )
    stops, regexes = params.stop_strings(), params.stop_regexes()
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(
            400,
            "invalid_request",
            f"stop: at most {MAX_STOP_STRINGS} non-empty strings",
            f"{field}.stop",
        )
    for pattern in regexes:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ApiError(
                400, "invalid_request", f"stop_regex {pattern!r}: {exc}", f"{field}.stop_regex"
            ) from exc
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids or []):
        raise ApiError(
            400,
            "invalid_request",
            "stop_token_ids must be in the vocabulary",
            f"{field}.stop_token_ids",
        )
    return params
