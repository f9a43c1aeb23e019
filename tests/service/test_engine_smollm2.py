"""The default engine (real SmolLM2-135M-Instruct) over HTTP: the agent's `</bash>` stop handling and
batched-vs-sequential greedy identity on real text."""

from __future__ import annotations

import asyncio

import pytest

from shellrl.clients.engine import EngineClient
from shellrl.models import load_tokenizer
from tests.helpers.engine import running_engine

SYSTEM = (
    "You run shell commands. Reply with exactly one command inside <bash></bash> tags, "
    "for example <bash>ls -la</bash>."
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine"), model_path="smollm2") as process:
        yield process


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def _prompt(tokenizer, request: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": request}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    return list(ids) + tokenizer.encode("<bash>", add_special_tokens=False)


async def test_bash_stop_string_with_no_stop_trim_keeps_the_stop_text_and_its_tokens(
    engine, tokenizer
):
    prompt = _prompt(tokenizer, "Show the current directory.")
    params = {
        "temperature": 0,
        "max_new_tokens": 24,
        "stop": ["</bash>", "</answer>"],
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    async with EngineClient([engine.url], timeout_s=120) as client:
        kept = await client.generate(prompt, params)
        trimmed = await client.generate(prompt, {**params, "no_stop_trim": False})
    stop_ids = tokenizer.encode("</bash>", add_special_tokens=False)
    assert kept.finish_reason == "stop" and kept.matched_stop == "</bash>"
    assert kept.text.endswith("</bash>") and kept.output_ids[-len(stop_ids) :] == stop_ids
    assert tokenizer.decode(kept.output_ids) == kept.text
    assert len(kept.output_logprobs) == len(kept.output_ids) == kept.completion_tokens
    assert trimmed.output_ids == kept.output_ids and trimmed.text == kept.text[: -len("</bash>")]


async def test_end_of_turn_token_stops_generation_and_is_kept_in_output_ids(engine, tokenizer):
    prompt = _prompt(tokenizer, "Show the current directory.")[:-2]  # without "<bash>": free reply
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    async with EngineClient([engine.url], timeout_s=120) as client:
        result = await client.generate(
            prompt, {"temperature": 0, "max_new_tokens": 24, "stop_token_ids": [eos]}
        )
    if result.finish_reason == "stop":
        assert (
            result.matched_stop == eos
            and result.output_ids[-1] == eos
            and "<|im_end|>" not in result.text
        )
    else:
        assert result.finish_reason == "length" and len(result.output_ids) == 24


async def test_real_model_batched_and_sequential_greedy_tokens_are_identical(engine, tokenizer):
    prompts = [
        _prompt(tokenizer, q)
        for q in (
            "Count the lines of notes.txt.",
            "Print the kernel name.",
            "Who am I?",
            "Show the first line of data.csv.",
        )
    ]
    params = {"temperature": 0, "max_new_tokens": 10}
    async with EngineClient([engine.url], timeout_s=300) as client:
        batched = await asyncio.gather(*(client.generate(p, params) for p in prompts))
        await client.flush_cache()
        sequential = [await client.generate(p, params) for p in prompts]
    assert [r.output_ids for r in batched] == [r.output_ids for r in sequential]
