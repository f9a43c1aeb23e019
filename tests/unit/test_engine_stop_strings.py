"""Stop strings are found however the model spelled them in tokens (the scheduler decodes a tail)."""

from __future__ import annotations

import asyncio

from services.engine.protocol import RequestSpec
from services.engine.request_state import new_request_state, stop_reason
from services.engine.sampling import SamplingSpec
from shellrl.models import load_tokenizer


def _byte_tokens(tokenizer, text: str) -> list[int]:
    """`text` spelled one byte-level BPE token per UTF-8 byte (GPT-2's byte-to-unicode table)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode("utf-8")]


def test_a_stop_string_generated_in_more_tokens_than_its_encoding_is_found():
    tokenizer = load_tokenizer("tiny")
    loop = asyncio.new_event_loop()
    try:
        for stop, spelled in (
            ("。", _byte_tokens(tokenizer, "。")),  # 1 token encoded, 3 byte tokens generated
            ("yyyyyy", [tokenizer.convert_tokens_to_ids("y")] * 6),
        ):
            assert len(spelled) > len(tokenizer.encode(stop, add_special_tokens=False))
            spec = RequestSpec(
                rid="r",
                input_ids=(1,),
                max_new_tokens=100,
                sampling=SamplingSpec(0.0),
                stop_strings=(stop,),
            )
            state = new_request_state(spec, loop, tokenizer, device=None)
            state.output_ids = [100, 101, *spelled]
            assert tokenizer.decode(state.output_ids[-state.stop_window_tokens :]).endswith(stop)
            assert stop_reason(state, tokenizer, eos_token_ids=set()) == {
                "type": "stop",
                "matched": stop,
            }
    finally:
        loop.close()
