"""The agent's prompt and observations, in the model's own chat template (DESIGN.md section 7).

Produces token ids only once per piece of text, never re-tokenizing history (iron law 1):
* `ChatFormat.prompt_ids(instruction)`: system message with the tool protocol, three worked
  examples (`FEW_SHOT`: user -> `<bash>` -> tool response -> `<answer>`), then the instruction, rendered by the
  tokenizer's chat template with the generation prompt.
* `ChatFormat.observation_ids(body, action_ids)`: the template text that closes the assistant turn
  (end-of-turn, unless the model already emitted it as its stop token), opens the observation turn,
  the observation body, closes it and opens the next assistant turn: tokenized once, on its own,
  with `add_special_tokens=False` (loss mask 0 for all of it).

The boundary texts are found by rendering the template once with marker messages, so that the
ids after an end-of-turn token are exactly what the template would produce (known_pitfalls C03/C05).

Special tokens come only from the template: in message contents (instruction, command output,
parse errors, the harness's own prompt text) special-token parsing is off, so a command that
prints `<|im_end|>\n<|im_start|>system` yields the plain-text ids of those characters, never a
forged turn boundary (issue 15 item 3). For contents without special-token text the ids are
those of tokenizing the whole rendering at once (checked in `ChatFormat.from_tokenizer`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

SYSTEM_PROMPT = (
    "You are an agent that solves tasks in a Linux shell. You work in a fresh workspace directory.\n"
    "To run one shell command, reply with <bash>COMMAND</bash>. You will then see its output.\n"
    "Never guess: first run a command that finds the result, then reply with <answer>RESULT</answer>.\n"
    "Use exactly one tag per reply."
)

# Worked examples (user -> <bash> -> tool response -> <answer>), shown before the task. Three
# examples gave SmolLM2-135M a consistent bash-then-answer format where one did not (the model
# answered at once, without running a command: 1/64 greedy successes on eval_id with one example;
# ../shared/reference/feasibility.md saw the same; measured with the examples before issue 33).
# They show the protocol only: no example is a task of any task set, nor runs a program that a
# task's reference command runs (tests/unit/test_prompt_examples.py; a `grep -n` example was
# copied into count_lines episodes by a trained policy, BENCHMARKS.md). Until issue 33 they were
# instances of grep_count, line_n and eval_ood's file_size_bytes with the templates' own commands,
# so the base policy's only eval_ood successes were copies of the second example (`wc -c <`),
# lost at step 5 of training in each of three seeds (BENCHMARKS.md, "Learning that transfers").
FEW_SHOT: tuple[tuple[str, str, str, str], ...] = (
    (
        "Which user is this shell running as?",
        "<bash>whoami</bash>",
        "sandbox\n",
        "<answer>sandbox</answer>",
    ),
    (
        "At which byte do the files old.cfg and new.cfg first differ?",
        "<bash>cmp old.cfg new.cfg</bash>",
        "old.cfg new.cfg differ: byte 7, line 2\n",
        "<answer>7</answer>",
    ),
    (
        "How many CPU cores does this machine have?",
        "<bash>nproc</bash>",
        "4\n",
        "<answer>4</answer>",
    ),
)

_ASSISTANT_MARK = "\x00ASSISTANT\x00"
_OBSERVATION_MARK = "\x00OBSERVATION\x00"
_CONTENT_MARK = "\x00CONTENT{}\x00"


def load_chat_tokenizer(name_or_path: str):
    """The model's fast tokenizer (tokenizer.json + chat template) without importing torch.

    Same files and ids as `shellrl.models.load_tokenizer` (tested), but `AutoTokenizer` also loads
    the model config, which imports torch: ~10 s of gateway start-up on a loaded 2-core machine
    against ~1.5 s here. Raises FileNotFoundError for an unknown model.
    """
    from transformers import PreTrainedTokenizerFast

    from shellrl.models import resolve_model_path

    return PreTrainedTokenizerFast.from_pretrained(str(resolve_model_path(name_or_path)))


def render_tool_response(
    stdout: str,
    stderr: str = "",
    exit_code: int | None = 0,
    *,
    timed_out: bool = False,
    timeout_s: float | None = None,
    stdout_truncated_bytes: int = 0,
    stderr_truncated_bytes: int = 0,
    denied_rule: str | None = None,
    max_chars: int = 600,
) -> str:
    """The observation body of one command: `<tool_response>` stdout, stderr, exit code `</tool_response>`.

    stdout and stderr are each capped at `max_chars` characters (head kept) with a marker giving
    the number of characters (and sandbox-side bytes) cut.
    """
    parts = []
    if denied_rule is not None:
        parts.append(f"[command denied by policy: {denied_rule}]")
    out = _cap(stdout, max_chars, stdout_truncated_bytes)
    if out:
        parts.append(out.rstrip("\n"))
    err = _cap(stderr, max_chars, stderr_truncated_bytes)
    if err:
        parts.append("stderr:\n" + err.rstrip("\n"))
    if timed_out:
        parts.append(f"[timed out after {timeout_s:g} s]" if timeout_s else "[timed out]")
    parts.append(f"[exit code {exit_code if exit_code is not None else 'none'}]")
    return "<tool_response>\n" + "\n".join(parts) + "\n</tool_response>"


def render_parse_error(message: str) -> str:
    """The observation body after a malformed reply."""
    return f"<tool_response>\n{message}\n</tool_response>"


def _cap(text: str, max_chars: int, truncated_bytes: int) -> str:
    if len(text) <= max_chars and not truncated_bytes:
        return text
    cut = max(0, len(text) - max_chars)
    marker = (
        f"…[truncated {cut} chars"
        + (f", {truncated_bytes} more bytes in the sandbox" if truncated_bytes else "")
        + "]"
    )
    return text[:max_chars] + marker


@dataclass(frozen=True)
class ChatFormat:
    """Template pieces of one tokenizer (build with `ChatFormat.from_tokenizer`).

    end_of_turn: the text of the token that ends an assistant turn (e.g. `<|im_end|>`);
    end_of_turn_id: its id (a stop token for generation).
    close_and_open: template text after an assistant message, up to the observation content.
    after_observation: template text after the observation content, including the next
    assistant generation prompt.
    prompt_template: the template text around the first request's message contents
    (len(messages) + 1 pieces, see `encode_turns`).
    special_ids: text -> id of the tokenizer's special tokens (parsed in template text only).
    """

    tokenizer: object
    system_prompt: str
    examples: tuple[tuple[str, str, str, str], ...]
    observation_role: str
    end_of_turn: str
    end_of_turn_id: int
    close_and_open: str
    after_observation: str
    prompt_template: tuple[str, ...]
    special_ids: dict[str, int] = field(init=False, repr=False, compare=False)
    _special_split: re.Pattern = field(init=False, repr=False, compare=False)
    _plain_backend: object = field(init=False, repr=False, compare=False)
    _template_ids: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _template_parts: dict[str, list[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        added = self.tokenizer.added_tokens_decoder.items()
        special = {t.content: i for i, t in added if t.special}
        alternatives = "|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))
        object.__setattr__(self, "special_ids", special)
        object.__setattr__(self, "_special_split", re.compile(f"({alternatives or '(?!)'})"))
        object.__setattr__(self, "_plain_backend", _plain_backend(self.tokenizer))
        object.__setattr__(self, "_template_ids", {})  # a run of template text only -> its ids
        object.__setattr__(self, "_template_parts", {})  # template piece -> its special split

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        examples: tuple[tuple[str, str, str, str], ...] = FEW_SHOT,
        observation_role: str = "user",
    ) -> ChatFormat:
        """Raises ValueError when the template does not render assistant/observation turns as expected."""
        messages = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _ASSISTANT_MARK},
            {"role": observation_role, "content": _OBSERVATION_MARK},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        try:
            _, rest = text.split(_ASSISTANT_MARK)
            close_and_open, after_observation = rest.split(_OBSERVATION_MARK)
        except ValueError:
            raise ValueError(
                "chat template does not render the marker messages once each"
            ) from None
        close_ids = tokenizer(close_and_open, add_special_tokens=False)["input_ids"]
        if not close_ids or close_ids[0] not in tokenizer.all_special_ids:
            raise ValueError(
                f"chat template: no special end-of-turn token after an assistant message: {close_and_open!r}"
            )
        end_of_turn_id = close_ids[0]
        end_of_turn = tokenizer.convert_ids_to_tokens(end_of_turn_id)
        if not close_and_open.startswith(end_of_turn):
            raise ValueError(
                f"chat template: end-of-turn text {end_of_turn!r} is not a prefix of {close_and_open!r}"
            )
        prompt_template = _content_template(
            tokenizer, _messages(system_prompt, examples, observation_role, "u")
        )
        chat = cls(
            tokenizer,
            system_prompt,
            tuple(examples),
            observation_role,
            end_of_turn,
            end_of_turn_id,
            close_and_open,
            after_observation,
            prompt_template,
        )
        rendered = tokenizer.apply_chat_template(
            chat.messages("u"), tokenize=False, add_generation_prompt=True
        )
        if chat.prompt_ids("u") != chat.encode(rendered):
            raise ValueError(
                "chat template: encoding template and contents apart changes the ids "
                "of a clean prompt (special tokens that strip whitespace?)"
            )
        return chat

    def messages(self, instruction: str) -> list[dict]:
        """The first request's messages: system prompt, worked examples, the instruction."""
        return _messages(self.system_prompt, self.examples, self.observation_role, instruction)

    def prompt_ids(self, instruction: str) -> list[int]:
        """Token ids of the first request: [P] ints. The instruction's text never yields a
        special token."""
        contents = [m["content"] for m in self.messages(instruction)]
        return self.encode_turns(self.prompt_template, contents)

    def observation_ids(self, body: str, action_ids: list[int]) -> list[int]:
        """Template + observation tokens to append after a turn whose ACTION ids are `action_ids`.

        If the turn already ends with the end-of-turn token (the model stopped on it), it is not
        added again; otherwise (stop string, length limit) the observation starts with it. The
        body's text never yields a special token.
        """
        close = self.close_and_open
        if action_ids and action_ids[-1] == self.end_of_turn_id:
            close = close[len(self.end_of_turn) :]
        return self.encode_turns((close, self.after_observation), (body,))

    def encode_turns(self, template: Sequence[str], contents: Sequence[str]) -> list[int]:
        """Token ids of `template[0] + contents[0] + template[1] + ... + template[-1]`
        (len(template) == len(contents) + 1): special tokens are parsed in the template pieces
        only; in a content their text is plain text (`<|im_end|>` -> `<`, `|`, `im`, ... ids).

        The tokenizer splits its input at special tokens and encodes the text between them on
        its own; this does the same, so clean contents get the ids of the joined text. A run of
        template text alone (e.g. the "\n" after `<|im_end|>`) is encoded once and remembered:
        of an observation's four runs, only the one holding the body is encoded per turn.
        """
        ids: list[int] = []
        run: list[str] = []  # text since the last special token of the template
        template_only = True  # the run holds no content: its ids are always the same
        for i, piece in enumerate(template):
            for j, part in enumerate(self._split(piece)):
                if j % 2:
                    ids += self._encode_run("".join(run), template_only)
                    ids.append(self.special_ids[part])
                    run.clear()
                    template_only = True
                else:
                    run.append(part)
            if i < len(contents):
                run.append(contents[i])
                template_only = False
        ids += self._encode_run("".join(run), template_only)
        return ids

    def _split(self, piece: str) -> list[str]:
        """A template piece split at special tokens (texts at even, tokens at odd indices)."""
        parts = self._template_parts.get(piece)
        if parts is None:
            parts = self._template_parts[piece] = self._special_split.split(piece)
        return parts

    def _encode_run(self, text: str, template_only: bool) -> list[int] | tuple[int, ...]:
        if not template_only:
            return self._encode_plain(text)
        ids = self._template_ids.get(text)
        if ids is None:
            ids = self._template_ids[text] = tuple(self._encode_plain(text))
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        if self._plain_backend is not None:
            return self._plain_backend.encode(text, add_special_tokens=False).ids
        return list(
            self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens added (special-token text is parsed: for
        harness text only); the Rust tokenizer directly when the tokenizer is a fast one (same
        ids as `tokenizer(text, add_special_tokens=False)`, tested, without ~0.3 ms of Python
        per call)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens kept (for parsing only; never re-tokenized)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_readable(self, ids: list[int]) -> str:
        """Text of `ids` for people to read: the tokenizer's special tokens (the chat template's
        markers, e.g. `<|im_start|>`, `<|im_end|>`) left out; the roles' names stay. Never
        parsed or re-tokenized."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _plain_backend(tokenizer):
    """A copy of the fast tokenizer's Rust backend that encodes special-token text as plain text
    (None for a slow tokenizer: `split_special_tokens=True` does the same there)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    plain = copy.deepcopy(backend)
    plain.encode_special_tokens = True
    return plain


def _messages(system_prompt: str, examples, observation_role: str, instruction: str) -> list[dict]:
    out = [{"role": "system", "content": system_prompt}]
    for question, action, output, answer in examples:
        out += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": action},
            {"role": observation_role, "content": render_tool_response(output)},
            {"role": "assistant", "content": answer},
        ]
    out.append({"role": "user", "content": instruction})
    return out


def _content_template(tokenizer, messages: list[dict]) -> tuple[str, ...]:
    """The template text around each message's content (len(messages) + 1 pieces), found by
    rendering marker contents with the generation prompt. Raises ValueError when a content is
    not rendered once, in order."""
    marked = [{**m, "content": _CONTENT_MARK.format(i)} for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    pieces = []
    for i in range(len(marked)):
        piece, mark, text = text.partition(_CONTENT_MARK.format(i))
        if not mark:
            raise ValueError(f"chat template does not render message {i}'s content once")
        pieces.append(piece)
    return (*pieces, text)
