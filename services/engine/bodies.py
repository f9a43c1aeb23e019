"""Request bodies of the engine's SGLang routes: reading the JSON and the control bodies' models.

`read_json(request)` is the one JSON reader of the engine: standard JSON only (no NaN/Infinity,
no number that overflows a float), nesting at most MAX_JSON_DEPTH deep, every string valid Unicode
(a lone UTF-16 surrogate such as `"\\ud800"` is refused naming its field: no tokenizer, regex or
HTTP header can take one). `parse_body(request, Model)` validates a control body; as in SGLang
0.5.23, whose routes take the body as a required pydantic/dataclass argument, a control call
without a body is refused (SGLang: 422; here 400 naming `body`), so an empty
`POST /pause_generation` pauses nothing. Errors are `ApiError(400)` naming the field.

The models follow SGLang's `managers/io_struct.py` (field names and defaults); shellrl adds
bounds where an unbounded value broke the engine (a 1 MB weight version served on every
response; a `truncate_size` that returned a whole tensor).
"""

from __future__ import annotations

import json
import math
import re
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from shellrl.service.app import ApiError
from shellrl.service.openapi import REF, json_body

MAX_JSON_DEPTH = 256
"""Arrays and objects nested deeper are refused (Python's json module recurses: 100,000 levels
raised RecursionError, a 500); no SGLang body nests more than 4 deep."""
MAX_WEIGHT_VERSION_CHARS = 256
MAX_TRUNCATE_SIZE = 1 << 20
"""Largest `get_weights_by_name` answer, in values (about 20 MB of JSON)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


WeightVersion = Field(
    None,
    max_length=MAX_WEIGHT_VERSION_CHARS,
    description="The version the engine reports after the update (on every response).",
)


class AbortBody(_Body):
    """SGLang's AbortReq: a rid (prefix match) or every request."""

    rid: str = ""
    abort_all: StrictBool = False


class PauseBody(_Body):
    """SGLang's PauseGenerationReqInput."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    """SGLang's ContinueGenerationReqInput (`torch_empty_cache` is a no-op here)."""

    torch_empty_cache: StrictBool = True


class BeginBody(_Body):
    selector: Literal["target", "draft", "all"] = "all"


class EndBody(_Body):
    """SGLang's EndWeightUpdateReqInput (no fields), plus shellrl's `discard`: true drops what the
    session staged, nothing goes live (a push its learner abandoned mid-way; SGLang, which loads
    each bucket as it comes, has no such field: the learner sends it only to shellrl's engine)."""

    discard: StrictBool = False


class TensorUpdateBody(_Body):
    """SGLang's UpdateWeightsFromTensorReqInput: one base64 MultiprocessingSerializer dump per TP
    rank (docs/sglang.md)."""

    serialized_named_tensors: list  # checked entry by entry (shellrl/weights/sglang.py)
    load_format: str | None = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = WeightVersion
    selector: str = "all"
    torch_empty_cache: StrictBool = False


class InitGroupBody(_Body):
    """SGLang's InitWeightsUpdateGroupReqInput (io_struct.py); rid is BaseReq's."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=0, le=1 << 16)
    world_size: StrictInt = Field(ge=1, le=1 << 16)
    group_name: str = Field("weight_update_group", max_length=255)
    backend: str = "nccl"
    rid: str | None = None


class DestroyGroupBody(_Body):
    group_name: str = Field("weight_update_group", max_length=255)
    rid: str | None = None


class DistributedUpdateBody(_Body):
    """SGLang's UpdateWeightsFromDistributedReqInput (io_struct.py)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[StrictInt]]
    group_name: str = Field("weight_update_group", max_length=255)
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = WeightVersion
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: StrictBool = False
    rid: str | None = None


class DiskUpdateBody(_Body):
    """SGLang's UpdateWeightFromDiskReqInput; this engine reads safetensors directories."""

    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = None
    abort_all_requests: StrictBool = False
    weight_version: str | None = WeightVersion
    is_async: StrictBool = False
    torch_empty_cache: StrictBool = False
    keep_pause: StrictBool = False
    recapture_cuda_graph: StrictBool = False
    token_step: StrictInt = 0
    flush_cache: StrictBool = True
    manifest: dict | None = None


class WeightVersionBody(_Body):
    new_version: str = Field(max_length=MAX_WEIGHT_VERSION_CHARS)
    abort_all_requests: StrictBool = True


class WeightsByNameBody(_Body):
    name: str = Field(max_length=1024)
    truncate_size: StrictInt = Field(100, ge=0, le=MAX_TRUNCATE_SIZE)


async def read_json(request: Request) -> object:
    """The body as JSON ({} when empty). ApiError(400) naming what is wrong: `invalid_json` (not
    JSON, NaN/Infinity, a float overflow, nested deeper than MAX_JSON_DEPTH), `invalid_request`
    naming the field of a string with a lone surrogate."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from exc
    except RecursionError:  # the C decoder counts its depth against the recursion limit
        body = None
    suspicious = _SURROGATE.search(raw) or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    problem, where = _scan(body) if suspicious and body is not None else (None, "")
    if body is None or problem == "depth":
        raise ApiError(
            400, "invalid_json", f"request body nests deeper than {MAX_JSON_DEPTH} levels"
        )
    if problem == "surrogate":
        raise ApiError(
            400,
            "invalid_request",
            f"{where or 'body'}: a lone UTF-16 surrogate is not valid Unicode",
            where or None,
        )
    return body


async def parse_body(request: Request, model: type[BaseModel]):
    """The body as `model`; ApiError(400) for no body at all (field `body`) or naming the first
    bad field."""
    if not await request.body():
        raise ApiError(
            400,
            "invalid_request",
            f"body: a JSON object is required ({model.__name__}; SGLang refuses a call without one)",
            "body",
        )
    try:
        return model.model_validate(await read_json(request))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or None
        raise ApiError(400, "invalid_request", f"{where}: {error['msg']}", where) from exc


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""Where a lone surrogate can come from: a `\\uD800`-`\\uDFFF` escape, or UTF-8-encoded surrogate
bytes (json.loads decodes bytes with 'surrogatepass'). A match only makes `_scan` look."""


def _scan(body: object) -> tuple[str | None, str]:
    """("depth", path) when arrays/objects nest deeper than MAX_JSON_DEPTH, ("surrogate", path of
    the first string or key with a lone UTF-16 surrogate: `sampling_params.stop[0]`, "" for the
    body itself), else (None, ""). Iterative (no recursion limit); ASCII strings, such as the
    base64 of a weight update, are passed at C speed."""
    stack: list[tuple[object, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                return "surrogate", path
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                return "depth", path
            if isinstance(value, dict):
                items = []
                for key, item in value.items():
                    inner = f"{path}.{key}" if path else str(key)
                    if not _encodable(key):
                        return "surrogate", inner.encode("utf-8", "backslashreplace").decode()
                    items.append((item, inner, depth + 1))
            else:
                items = [
                    (item, f"{path}[{i}]", depth + 1)
                    for i, item in enumerate(value)
                    if isinstance(item, (str, dict, list))
                ]
            stack.extend(reversed(items))  # depth-first, in document order
    return None, ""


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _finite_float(text: str) -> float:
    """A JSON number too large for a float (`1e999`) would read as inf."""
    value = float(text)
    if not math.isfinite(value):
        raise ApiError(
            400, "invalid_json", f"request body is not valid JSON: {text} overflows a float"
        )
    return value


def _no_constant(name: str):
    """Python's json accepts NaN/Infinity, which JSON does not (a temperature of Infinity would
    sample uniformly)."""
    raise ApiError(
        400, "invalid_json", f"request body is not valid JSON: {name} is not a JSON number"
    )


class UpdateResult(BaseModel):
    """The answer of SGLang's weight-update routes (HTTP 200, or 400 when it failed)."""

    success: bool
    message: str


def route_doc(model: type[BaseModel] | None = None, *, update: bool = False) -> dict:
    """Decorator kwargs documenting a control route: its required JSON body `model` and its 400
    (`ErrorBody`; for a weight update also `UpdateResult` with success false)."""
    bad: dict = {"$ref": REF.format(model="ErrorBody")}
    if update:
        bad = {"anyOf": [bad, {"$ref": REF.format(model="UpdateResult")}]}
    doc: dict = {
        "responses": {
            400: {
                "description": "Bad request (names the field), or the update failed",
                "content": {"application/json": {"schema": bad}},
            }
        }
    }
    if model is not None:
        doc["openapi_extra"] = json_body(model)
    return doc
