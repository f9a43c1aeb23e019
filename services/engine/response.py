"""SGLang's response object for a finished `/generate` request (docs/sglang.md §1):
`{"text", "output_ids", "meta_info"}`, plus `prompt_token_ids` when asked.
"""

from __future__ import annotations

import re

from services.engine.protocol import RequestSpec


def render_response(state, tokenizer) -> dict:
    """SGLang's response object for a finished request (`state`: request_state.RequestState)."""
    spec: RequestSpec = state.spec
    finish = state.finish_reason
    ids = state.output_ids
    text_ids = ids
    if (
        not spec.no_stop_trim
        and finish.get("type") == "stop"
        and isinstance(finish.get("matched"), int)
    ):
        text_ids = ids[:-1]  # the matched stop token is kept in output_ids but cut from text
    text = (
        tokenizer.decode(
            text_ids,
            skip_special_tokens=spec.skip_special_tokens,
            spaces_between_special_tokens=spec.spaces_between_special_tokens,
        )
        if text_ids
        else ""
    )
    if (
        not spec.no_stop_trim
        and finish.get("type") == "stop"
        and isinstance(finish.get("matched"), str)
    ):
        cut = _find_stop(text, finish["matched"], spec.stop_regex)
        if cut >= 0:
            text = text[:cut]
    meta = {
        "id": spec.rid,
        "finish_reason": finish,
        "completion_tokens": len(ids),
        "cached_tokens": state.cached_tokens,
        "weight_version": state.spans[-1][0] if state.spans else state.weight_version_at_end,
        "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in state.spans],
        "num_retractions": state.num_retractions,
        "reasoning_tokens": 0,
        "e2e_latency": state.e2e_latency_s,
    }
    if not state.aborted_in_queue:
        meta["prompt_tokens"] = len(spec.input_ids)
    if spec.return_logprob:
        texts = (
            [tokenizer.decode([t]) for t in ids]
            if spec.return_text_in_logprobs
            else [None] * len(ids)
        )
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(state.logprobs, ids, texts)]
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs_length"] = len(ids)
    out = {"text": text, "output_ids": list(ids), "meta_info": meta}
    if spec.return_prompt_token_ids:
        out["prompt_token_ids"] = list(spec.input_ids)
    return out


def _find_stop(text: str, matched: str, regexes: tuple[str, ...]) -> int:
    if matched in regexes:
        found = re.search(matched, text)
        return found.start() if found else -1
    return text.find(matched)
