"""What an engine answers, checked: `GenerateResult` (with its `VersionSpan`s), `UpdateResult`, and
the errors `EngineUnavailable` and `EngineError` that `shellrl.clients.engine.EngineClient` raises.

Formats are SGLang 0.5.23's (docs/sglang.md). Parsing is pure (no I/O): a body that breaks the
contract raises `EngineError` naming what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import httpx


class EngineUnavailable(Exception):
    """The engine could not be reached, or did not answer within the timeout (`timed_out`)."""

    def __init__(self, url: str, message: str, *, timed_out: bool = False) -> None:
        super().__init__(f"{url}: {message}")
        self.url, self.timed_out = url, timed_out


class EngineError(Exception):
    """The engine answered with HTTP 4xx/5xx, or with a body that breaks the contract."""

    def __init__(self, url: str, status: int, body: Any, message: str | None = None) -> None:
        super().__init__(f"{url}: HTTP {status}: {message or _error_text(body)}")
        self.url, self.status, self.body = url, status, body


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens `[start, end)` of one response were generated with weights `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class GenerateResult:
    """One `/generate` answer, checked: `output_ids[i]` was sampled with log-prob `output_logprobs[i]`.

    finish_reason: "stop" (EOS, stop token or stop string; `matched_stop` is the int token id or the
    str stop string), "length" (max_new_tokens reached), or "abort" (aborted; the tokens so far are
    kept). output_logprobs: float log-probs, `log_softmax(logits / temperature)` of each sampled
    token over the full vocabulary (before top-p/top-k), the raw distribution for greedy requests;
    empty when `return_logprob` was false. weight_version: the engine's version when the response
    ended; `weight_versions` says which version produced which tokens when an update landed mid-way.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    matched_stop: int | str | None
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    engine_url: str
    rid: str = ""
    cached_tokens: int = 0
    weight_versions: tuple[VersionSpan, ...] = field(default_factory=tuple)
    e2e_latency_s: float | None = None


@dataclass(frozen=True)
class UpdateResult:
    """Answer of a weight-update call: `{"success": bool, "message": str}`."""

    success: bool
    message: str


def parse_generate_response(
    data: dict, *, engine_url: str, return_logprob: bool, prompt_tokens: int = 0
) -> GenerateResult:
    """Checked `GenerateResult` from one `/generate` JSON object (SGLang §1.4 shape).

    Raises EngineError when the body breaks the contract: no meta_info, logprob entries that do not
    match `output_ids` one to one (sglang PR #20799 class of bug), a log-prob that is not a finite
    number <= 0 (NaN, +-inf, JSON null, > 0: a broken engine, never training data), or an unknown
    finish reason.
    """
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(engine_url, 200, data, "response has no meta_info")
    output_ids = [int(t) for t in data.get("output_ids") or []]
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type")
    if reason not in ("stop", "length", "abort"):
        raise EngineError(engine_url, 200, data, f"unknown finish_reason {finish!r}")
    logprobs: list[float] = []
    if return_logprob:
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(output_ids) or any(
            int(e[1]) != t for e, t in zip(entries, output_ids)
        ):
            raise EngineError(
                engine_url,
                200,
                data,
                f"output_token_logprobs ({len(entries)}) do not match output_ids ({len(output_ids)})",
            )
        logprobs = [_checked_logprob(e[0], i, engine_url, data) for i, e in enumerate(entries)]
    version = str(meta.get("weight_version", "default"))
    spans = tuple(
        VersionSpan(str(s["version"]), int(s["start"]), int(s["end"]))
        for s in meta.get("weight_versions") or ()
    )
    if not spans and output_ids:
        spans = (VersionSpan(version, 0, len(output_ids)),)
    latency = meta.get("e2e_latency")
    return GenerateResult(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=reason,
        matched_stop=finish.get("matched"),
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        text=data.get("text", ""),
        engine_url=engine_url,
        rid=str(meta.get("id", "")),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        weight_versions=spans,
        e2e_latency_s=float(latency) if latency is not None else None,
    )


def _checked_logprob(value: Any, index: int, engine_url: str, data: dict) -> float:
    """One sampled token's log-prob as a float; EngineError unless it is finite and <= 0."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value > 0:
        raise EngineError(
            engine_url,
            200,
            data,
            f"output_token_logprobs[{index}] is {value!r}: a log-prob must be finite and <= 0",
        )
    return float(value)


def raise_on_failure(url: str, response: httpx.Response) -> UpdateResult:
    """The `UpdateResult` of a weight-update answer; EngineError unless it says `success: true`."""
    data = body_of(response)
    if not isinstance(data, dict) or not data.get("success", False):
        raise EngineError(url, response.status_code, data, f"update failed: {_error_text(data)}")
    return UpdateResult(success=True, message=str(data.get("message", "")))


def body_of(response: httpx.Response) -> Any:
    """The response's JSON, or its text when it is no JSON."""
    try:
        return response.json()
    except ValueError:
        return response.text


def error_code(body: Any) -> str | None:
    """shellrl's `{"error": {"code"}}`; None for other bodies."""
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]
