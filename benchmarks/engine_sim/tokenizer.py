"""The simulator's deterministic tokenizer and chat template, usable offline.

The harness and the picker tests import this module to compute exactly the token ids the simulator
computes, without a running simulator.

Tokenizer: one token per whitespace-separated word. Template tags (``<|system|>``, ``<|user|>``,
``<|assistant|>``, ``<|tool|>``, ``<|end|>``) have fixed ids below ``FIRST_WORD_ID``; every other word
gets ``FIRST_WORD_ID + blake2b-64(word) mod (VOCAB_SIZE - FIRST_WORD_ID)``. The literal form
``<|id:N|>`` encodes to id N, so ``decode`` output always re-encodes to the same ids. Tokenizing is
prefix-preserving: the tokens of ``a + " " + b`` are the tokens of ``a`` followed by those of ``b``.

Chat template (no BOS token)::

    <|system|> {content} <|end|> <|user|> {content} <|end|> ... [<|assistant|>]

Roles ``system``/``developer`` → ``<|system|>``, ``user`` → ``<|user|>``, ``assistant`` →
``<|assistant|>``, ``tool`` → ``<|tool|>``. Content is a string or a list of OpenAI content parts
(text parts are joined by a space; other parts are dropped). With ``add_generation_prompt`` the
rendering ends with ``<|assistant|>``. A multi-turn history therefore renders to a token prefix of the
next turn's prompt.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from hashlib import blake2b
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

VOCAB_SIZE = 32_000
FIRST_WORD_ID = 256  # ids below this are reserved for template tags
SPECIAL_TOKENS: dict[str, int] = {
    "<|system|>": 1,
    "<|user|>": 2,
    "<|assistant|>": 3,
    "<|tool|>": 4,
    "<|end|>": 5,
}
SPECIAL_BY_ID: dict[int, str] = {v: k for k, v in SPECIAL_TOKENS.items()}
ROLE_TAGS: dict[str, str] = {
    "system": "<|system|>",
    "developer": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
END_TAG = "<|end|>"
GENERATION_PROMPT = "<|assistant|>"
_LITERAL_ID = re.compile(r"^<\|id:(\d+)\|>$")
# A short fixed vocabulary for the simulator's generated output (deterministic text).
_OUTPUT_VOCAB = (
    "the cache block prefix token engine replica route picker index event batch queue model "
    "prompt reply stream chunk usage metric hit miss evict store page layer decode prefill"
)
OUTPUT_WORDS: tuple[str, ...] = tuple(_OUTPUT_VOCAB.split(" "))


class TemplateError(ValueError):
    """A chat request the template cannot render (unknown role, bad content shape)."""


@lru_cache(maxsize=1 << 16)  # bound: 65,536 distinct words; LRU eviction (functools)
def word_id(word: str) -> int:
    """The token id of one word (a template tag, a ``<|id:N|>`` literal, or a hashed word)."""
    special = SPECIAL_TOKENS.get(word)
    if special is not None:
        return special
    literal = _LITERAL_ID.match(word)
    if literal is not None and int(literal.group(1)) < VOCAB_SIZE:
        return int(literal.group(1))
    digest = blake2b(word.encode("utf-8"), digest_size=8).digest()
    return FIRST_WORD_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_WORD_ID)


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one per whitespace-separated word."""
    return [word_id(w) for w in text.split()]


class Detokenizer:
    """Maps ids back to words it has seen encoded; unknown ids render as ``<|id:N|>``.

    Bound: at most one remembered word per id, so at most ``VOCAB_SIZE`` entries (a newer word with
    the same id replaces the older one).
    """

    def __init__(self) -> None:
        self._words: dict[int, str] = {}

    def remember(self, text: str) -> None:
        """Record the words of ``text`` so their ids decode back to them."""
        for w in text.split():
            self._words[word_id(w)] = w

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of ``token_ids`` (words joined by single spaces)."""
        out: list[str] = []
        for t in token_ids:
            special = SPECIAL_BY_ID.get(t)
            out.append(special or self._words.get(t) or f"<|id:{t}|>")
        return " ".join(out)


def content_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` (a string, a list of parts, or None)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise TemplateError("content part 'text' must be a string")
                texts.append(text)
        return " ".join(texts)
    raise TemplateError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The chat template applied to OpenAI ``messages`` (see the module docstring)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise TemplateError("'messages' must be a list")
    pieces: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{i}] must be an object")
        role = message.get("role")
        tag = ROLE_TAGS.get(role) if isinstance(role, str) else None
        if tag is None:
            raise TemplateError(f"messages[{i}].role {role!r} is not one of {sorted(ROLE_TAGS)}")
        pieces.append(tag)
        text = content_text(message.get("content"))
        if text:
            pieces.append(text)
        pieces.append(END_TAG)
    if add_generation_prompt:
        pieces.append(GENERATION_PROMPT)
    return " ".join(pieces)


def chat_token_ids(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` with the chat template applied."""
    return encode(render_chat(messages, add_generation_prompt))


def prompt_token_ids(prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a completions ``prompt`` (a string, or already token ids)."""
    if isinstance(prompt, str):
        return encode(prompt)
    ids = list(prompt)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < VOCAB_SIZE:
            raise TemplateError(f"token id {t!r} out of range 0..{VOCAB_SIZE - 1}")
    return ids


# vLLM's CompletionRequest field types (vllm/entrypoints/openai/completion/protocol.py): ``prompt`` is
# ``list[int >= 0] | list[list[int >= 0]] | str | list[str]`` and ``max_tokens`` is ``int | None``,
# validated by pydantic in lax mode, so ``4.0`` and ``"4"`` are 4 while ``4.5`` is refused. The same
# adapters here accept and refuse exactly what that model does.
_PROMPT = TypeAdapter(list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | str | list[str])
_OPTIONAL_INT = TypeAdapter(int | None)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return str(err.get("msg", "invalid value"))


def lax_int(value: Any, name: str) -> int | None:
    """``value`` as vLLM's pydantic ``int | None`` field reads it (lax mode). Raises TemplateError."""
    try:
        result = _OPTIONAL_INT.validate_python(value)
    except ValidationError as exc:
        raise TemplateError(f"'{name}': {_first_error(exc)}, got {value!r}") from None
    return result if result is None else int(result)


def completion_prompts(prompt: Any) -> list[list[int]]:
    """The prompts of a completions ``prompt`` as token ids, one list per prompt, in order.

    A string or a list of token ids is one prompt; a list of strings or a list of token-id lists is a
    batch (vLLM answers it with one choice per prompt). Token ids are used as given (they must lie in
    the vocabulary). Raises TemplateError for anything vLLM's model refuses, and for an empty batch.
    """
    try:
        parsed = _PROMPT.validate_python(prompt)
    except ValidationError:
        raise TemplateError(
            "'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists"
        ) from None
    if isinstance(parsed, str):
        return [encode(parsed)]
    if not parsed:
        raise TemplateError("'prompt' is empty")
    if isinstance(parsed[0], str):
        return [encode(p) for p in parsed]
    if isinstance(parsed[0], list):
        return [prompt_token_ids(p) for p in parsed]
    return [prompt_token_ids(parsed)]


_RESPONSES_TEXT_PARTS = ("input_text", "output_text", "text")


def responses_token_ids(body: Mapping[str, Any]) -> list[int]:
    """Prompt token ids of a Responses API body: ``instructions`` as a system message, then ``input``
    (a string is one user message; a list holds message items ``{"role", "content"}`` whose content
    is a string or text parts), rendered with the chat template and its generation prompt.

    Refused (TemplateError) as vLLM refuses it: a ``prompt`` template. Refused by the simulator only:
    input items other than messages (tool calls and their outputs, reasoning items)."""
    if body.get("prompt") is not None:
        raise TemplateError("prompt template is not supported")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise TemplateError("'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, Mapping) or item.get("type", "message") != "message" or "role" not in item:
                raise TemplateError(f"input[{i}]: the simulator renders message items only")
            content = item.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if isinstance(part, Mapping) and part.get("type") in _RESPONSES_TEXT_PARTS:
                        text = part.get("text", "")
                        if not isinstance(text, str):
                            raise TemplateError(f"input[{i}]: content part 'text' must be a string")
                        texts.append(text)
                content = " ".join(texts)
            messages.append({"role": item["role"], "content": content})
    else:
        raise TemplateError("'input' must be a string or a list of input items")
    return chat_token_ids(messages, add_generation_prompt=True)


def request_token_ids(path: str, body: Mapping[str, Any]) -> list[int]:
    """Prompt token ids of an OpenAI request body as the simulator computes them.

    Chat bodies (``messages``) get the template with the generation prompt; completions bodies use
    ``prompt`` (a string, token ids, or a one-element list of either). Raises TemplateError.
    """
    if "messages" in body or path.endswith("/chat/completions"):
        return chat_token_ids(body.get("messages") or [], add_generation_prompt=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list):
        return prompt_token_ids(prompt)
    raise TemplateError("'prompt' must be a string, a list of token ids, or a one-element list of either")


def output_word(prompt_ids: Sequence[int], index: int) -> str:
    """The simulator's deterministic generated word number ``index`` (0-based) for a prompt."""
    start = (prompt_ids[-1] if prompt_ids else 0) + len(prompt_ids)
    return OUTPUT_WORDS[(start + index) % len(OUTPUT_WORDS)]


def output_words(prompt_ids: Sequence[int], count: int) -> list[str]:
    """The simulator's deterministic generated words for a prompt (one word = one token)."""
    return [output_word(prompt_ids, i) for i in range(count)]
