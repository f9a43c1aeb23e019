"""One request inside the engine: its state, how it records a token, when it stops, how it ends.

`RequestState` is created on the HTTP event loop (`new_request_state`, at `/generate`) and mutated
only by the scheduler thread afterwards; its asyncio future resolves with the finished state
(`finish`, scheduled onto the request's loop). Finish reasons are SGLang's dicts
(`{"type": "stop" | "length" | "abort", ...}`); an abort keeps every token generated so far.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import torch

from services.engine import metrics
from services.engine.protocol import RequestSpec

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_IN_QUEUE = {"type": "abort", "message": "Abort in waiting queue"}


class DuplicateRequestId(ValueError):
    pass


@dataclass(eq=False)
class RequestState:
    """A request's progress. Mutated only by the scheduler thread after `submit`."""

    spec: RequestSpec
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    created_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list] = field(
        default_factory=list
    )  # [weight_version, start, end) over output tokens
    finish_reason: dict | None = None
    cached_tokens: int = 0
    num_retractions: int = 0
    aborted_in_queue: bool = False
    e2e_latency_s: float = 0.0
    weight_version_at_end: str = ""
    stop_window_tokens: int = 0
    generator: torch.Generator | None = None
    kv_generation: int = -1  # prefix-cache generation its KV belongs to
    kv_inserted: int = 0  # tokens of its sequence already offered to the prefix cache

    def tokens(self) -> list[int]:
        return [*self.spec.input_ids, *self.output_ids]

    def append(self, token: int, logprob: float, weight_version: str) -> None:
        """Record one sampled token, labelled with the weight version that computed it (`spans`)."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        n = len(self.output_ids)
        if self.spans and self.spans[-1][0] == weight_version:
            self.spans[-1][2] = n
        else:
            self.spans.append([weight_version, n - 1, n])


def new_request_state(
    spec: RequestSpec,
    loop: asyncio.AbstractEventLoop,
    tokenizer,
    *,
    device: torch.device | str | None,
) -> RequestState:
    """A fresh state for `spec`, its future on `loop`; `device` holds its sampling generator
    (seeded requests only)."""
    state = RequestState(spec, loop.create_future(), loop)
    # The tail decoded for stop strings: a generated stop string can be split into more tokens than
    # its own encoding (e.g. "yyyyyy" generated as 6 tokens, encoded as 2; "。" as its 3 byte
    # tokens, encoded as 1); every byte-level BPE token holds at least one byte, so its UTF-8 length
    # + 1 tokens always hold it. SGLang also searches the whole decoded text
    # (Req._check_str_based_finish).
    state.stop_window_tokens = 1 + max(
        (
            max(len(s.encode("utf-8")), len(tokenizer.encode(s, add_special_tokens=False)))
            for s in spec.stop_strings
        ),
        default=0,
    )
    if spec.stop_regex:
        state.stop_window_tokens = max(state.stop_window_tokens, 64)
    if spec.sampling.seed is not None:
        state.generator = torch.Generator(device=device).manual_seed(spec.sampling.seed)
    return state


def stop_reason(state: RequestState, tokenizer, eos_token_ids: set[int]) -> dict | None:
    """SGLang 0.5.23's order (managers/schedule_batch.py:Req.update_finish_state): stop string or
    regex, then stop token or EOS (both off with ignore_eos), then length. So a stop on the last
    allowed token is "stop", not "length": the learner's overlong filter reads it as complete."""
    spec, token = state.spec, state.output_ids[-1]
    if spec.stop_strings or spec.stop_regex:
        tail = tokenizer.decode(
            state.output_ids[-state.stop_window_tokens :],
            skip_special_tokens=spec.skip_special_tokens,
        )
        for stop in spec.stop_strings:
            if stop in tail:
                return {"type": "stop", "matched": stop}
        for pattern in spec.stop_regex:
            if re.search(pattern, tail):
                return {"type": "stop", "matched": pattern}
    if not spec.ignore_eos and (token in spec.stop_token_ids or token in eos_token_ids):
        return {"type": "stop", "matched": token}
    if len(state.output_ids) >= spec.max_new_tokens:
        return {"type": "length", "length": spec.max_new_tokens}
    return None


def engine_error(exc: Exception) -> dict:
    """The finish reason of a request whose forward pass failed (HTTP 500 at `/generate`)."""
    return {
        "type": "abort",
        "message": f"engine error: {exc!r}",
        "status_code": 500,
        "err_type": "InternalServerError",
    }


def finish(state: RequestState, reason: dict, weight_version: str) -> None:
    """End the request with `reason` (weights `weight_version` at its end): count it and resolve its
    future on its event loop (scheduler thread; nobody waits when that loop is gone)."""
    state.finish_reason = reason
    state.e2e_latency_s = time.monotonic() - state.created_s
    state.weight_version_at_end = weight_version
    kind = reason["type"]
    metrics.REQUESTS.labels(kind).inc()
    metrics.REQUEST_SECONDS.labels(kind).observe(state.e2e_latency_s)
    try:
        state.loop.call_soon_threadsafe(_resolve, state)
    except RuntimeError:  # the event loop is gone (shutdown): nobody waits for this answer
        pass


def _resolve(state: RequestState) -> None:
    if not state.future.done():
        state.future.set_result(state)
