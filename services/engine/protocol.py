"""`/generate` request parsing in SGLang's format (docs/sglang.md §1).

Input: the JSON body of `POST /generate` (single or batch). Output: one `RequestSpec` per prompt,
validated, or `ApiError(400)` naming the offending field. `sampling_params` is validated in
sampling_params.py; response.py renders a finished request as SGLang's response object.
`generate_request_schema()` documents the body in the engine's OpenAPI document.

Strictness: unknown keys inside `sampling_params` are rejected, as SGLang 0.5.23 does; unknown
top-level keys are rejected too (SGLang ignores them; shellrl prefers a clear error). SGLang
fields this engine does not implement are accepted only with their default value.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.sampling import SamplingSpec
from services.engine.sampling_params import SglangSamplingParams, parse_sampling_params
from shellrl.service.app import ApiError
from shellrl.service.openapi import REF

# Top-level SGLang fields accepted only with these (default) values.
_DEFAULT_ONLY = {
    "logprob_start_len": (-1,),
    "top_logprobs_num": (0,),
    "token_ids_logprob": (None,),
    "stream": (False,),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "lora_path": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "input_embeds": (None,),
    "custom_logit_processor": (None,),
    "session_params": (None,),
    "return_sampling_mask": (False,),
}
# Top-level SGLang fields that do not change what this engine computes.
_IGNORED = {
    "priority",
    "extra_key",
    "cache_salt",
    "routing_key",
    "session_id",
    "routed_dp_rank",
    "data_parallel_rank",
    "log_metrics",
    "routed_experts_start_len",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
}
_HANDLED = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "return_text_in_logprobs",
    "return_prompt_token_ids",
}


@dataclass(frozen=True)
class RequestSpec:
    """One validated generation request."""

    rid: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingSpec
    stop_strings: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context_length: int


def parse_generate(
    body: object, limits: ModelLimits, tokenizer, new_rid
) -> tuple[list[RequestSpec], bool]:
    """Validated specs for a `/generate` body and whether it was a batch. Raises ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "request body must be a JSON object")
    for key in body:
        if key in _DEFAULT_ONLY:
            value = body[key]  # the default itself, of its type: 0 is no `False`, nor 1.0 `1`
            if value is not None and not any(
                type(value) is type(d) and value == d for d in _DEFAULT_ONLY[key]
            ):
                raise ApiError(
                    400,
                    "unsupported",
                    f"{key}={value!r} is not supported by shellrl's engine",
                    key,
                )
        elif key not in _HANDLED and key not in _IGNORED:
            raise ApiError(400, "unknown_field", f"unknown field {key!r}", key)
    for key in ("return_text_in_logprobs", "return_prompt_token_ids"):
        if not isinstance(body.get(key, False), bool):
            raise ApiError(400, "invalid_request", f"{key} must be true or false", key)
    prompts, is_batch = _prompts(body, tokenizer, limits)
    count = len(prompts)
    params = _per_item(body.get("sampling_params") or {}, count, "sampling_params", dict, is_batch)
    return_logprob = _per_item(
        body.get("return_logprob", False), count, "return_logprob", bool, is_batch
    )
    rids = _rids(body.get("rid"), count, is_batch, new_rid)
    specs = []
    for i, (ids, raw, logprob, rid) in enumerate(zip(prompts, params, return_logprob, rids)):
        field = (
            f"sampling_params[{i}]"
            if isinstance(body.get("sampling_params"), list)
            else "sampling_params"
        )
        specs.append(_spec(rid, ids, raw, field, limits, bool(logprob), body))
    return specs, is_batch


def _prompts(body: dict, tokenizer, limits: ModelLimits) -> tuple[list[list[int]], bool]:
    given = [k for k in ("text", "input_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise ApiError(
            400,
            "invalid_request",
            "Either text or input_ids should be provided (exactly one).",
            "input_ids",
        )
    if given[0] == "text":
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(
                400,
                "invalid_request",
                "text must be a string or a non-empty list of strings",
                "text",
            )
        # the tokenizer's defaults (special tokens such as a BOS included), as SGLang's tokenizer manager
        prompts = [tokenizer.encode(t) for t in texts]
        is_batch = isinstance(text, list)
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise ApiError(400, "invalid_request", "input_ids cannot be empty.", "input_ids")
        is_batch = isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
    for i, prompt in enumerate(prompts):
        field = f"{given[0]}[{i}]" if is_batch else given[0]
        if not isinstance(prompt, list) or not prompt:
            raise ApiError(400, "invalid_request", f"{given[0]} cannot be empty.", field)
        bad = [t for t in prompt if type(t) is not int or not 0 <= t < limits.vocab_size]
        if bad:
            raise ApiError(
                400,
                "invalid_request",
                f"token ids must be integers in [0, {limits.vocab_size}); got {bad[:5]!r}",
                field,
            )
        if len(prompt) >= limits.context_length:
            raise ApiError(
                400,
                "invalid_request",
                f"The input ({len(prompt)} tokens) is longer than the model's "
                f"context length ({limits.context_length} tokens).",
                field,
            )
    return prompts, is_batch


def _per_item(value, count: int, field: str, kind: type, is_batch: bool) -> list:
    if isinstance(value, list) and kind is not list:
        if not is_batch or len(value) != count:
            raise ApiError(
                400,
                "invalid_request",
                f"{field} list must have one entry per prompt ({count})",
                field,
            )
        items = value
    else:
        items = [value] * count
    for item in items:
        if not isinstance(item, kind):
            raise ApiError(
                400,
                "invalid_request",
                f"{field} must be a {kind.__name__} or a list of them",
                field,
            )
    return items


def _max_new_tokens(requested: int | None, prompt_len: int, limits: ModelLimits, field: str) -> int:
    """SGLang's total-token check (managers/tokenizer_manager.py, `validate_total_tokens`, on by default):
    prompt + max_new_tokens beyond the context length is a 400, not a silent clip; None means the
    room left in the context."""
    room = limits.context_length - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise ApiError(
            400,
            "invalid_request",
            "Requested token count exceeds the model's maximum context length "
            f"of {limits.context_length} tokens. You requested a total of {prompt_len + requested} tokens: "
            f"{prompt_len} tokens from the input messages and {requested} tokens for the completion.",
            f"{field}.max_new_tokens",
        )
    return requested


def _rids(rid, count: int, is_batch: bool, new_rid) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(count)]
    if isinstance(rid, str) and rid:
        return [f"{rid}_{i}" for i in range(count)] if is_batch else [rid]
    if (
        isinstance(rid, list)
        and is_batch
        and len(rid) == count
        and all(isinstance(r, str) and r for r in rid)
    ):
        if len(set(rid)) != count:
            raise ApiError(400, "invalid_request", "rid list has duplicates", "rid")
        return list(rid)
    raise ApiError(
        400,
        "invalid_request",
        "rid must be a non-empty string (or one per prompt in a batch)",
        "rid",
    )


def _spec(
    rid: str,
    ids: list[int],
    raw: dict,
    field: str,
    limits: ModelLimits,
    return_logprob: bool,
    body: dict,
) -> RequestSpec:
    params = parse_sampling_params(raw, field, limits.vocab_size)
    return RequestSpec(
        rid=rid,
        input_ids=tuple(ids),
        max_new_tokens=_max_new_tokens(params.max_new_tokens, len(ids), limits, field),
        sampling=SamplingSpec(
            params.temperature, params.top_p, params.top_k, params.min_p, params.sampling_seed
        ),
        stop_strings=params.stop_strings(),
        stop_regex=params.stop_regexes(),
        stop_token_ids=frozenset(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
        no_stop_trim=params.no_stop_trim,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        return_logprob=return_logprob,
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids", False)),
    )


def generate_request_schema() -> dict:
    """JSON Schema of the `/generate` body this engine accepts (SGLang's GenerateReqInput subset):
    exactly one of `text`/`input_ids`, a batch when it is a list of prompts, per-prompt lists of
    `sampling_params`/`rid`/`return_logprob` in a batch; the SGLang fields of `_DEFAULT_ONLY`
    only at their default, those of `_IGNORED` as anything. `SamplingParams` goes to `$defs`."""
    params = SglangSamplingParams.model_json_schema(ref_template=REF)
    params_ref = {"$ref": REF.format(model="SamplingParams")}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    flag = {"type": "boolean"}
    null = {"type": "null"}
    text = {"type": "string", "minLength": 1}
    texts = {"oneOf": [text, {"type": "array", "items": text, "minItems": 1}]}
    prompts = {"oneOf": [ids, {"type": "array", "items": ids, "minItems": 1}]}
    properties: dict = {
        "text": {"oneOf": [*texts["oneOf"], null]},
        "input_ids": {"oneOf": [*prompts["oneOf"], null]},
        "sampling_params": {"oneOf": [params_ref, {"type": "array", "items": params_ref}, null]},
        "rid": {
            "oneOf": [text, {"type": "array", "items": text}, null],
            "description": "null: a fresh uuid",
        },
        "return_logprob": {"oneOf": [flag, {"type": "array", "items": flag}]},
        "return_text_in_logprobs": flag,
        "return_prompt_token_ids": flag,
    }
    for name, allowed in _DEFAULT_ONLY.items():
        properties[name] = {"enum": list(dict.fromkeys([*allowed, None])), "description": "default"}
    for name in sorted(_IGNORED):
        properties[name] = {"description": "accepted, ignored"}
    return {
        "$defs": {"SamplingParams": params, **params.pop("$defs", {})},
        "type": "object",
        "properties": properties,
        "anyOf": [  # exactly one of them not null
            {"required": ["text"], "properties": {"text": texts, "input_ids": null}},
            {"required": ["input_ids"], "properties": {"input_ids": prompts, "text": null}},
        ],
        "additionalProperties": False,
    }
