"""What a prompt's request may be: the one definition the producer (on every input line) and the
worker (on every job it claims) both apply, so a job written into Redis by anyone else is held to
exactly the rules a line of the input file is.

A request is `(url, body)`: `url` is one of `records.ENDPOINTS`, a path relative to the worker's own
server (never an absolute URL: the server's API key must never be sent anywhere else), and `body`
is the OpenAI request as sent, with canonical key names only:

- `/v1/chat/completions`: `messages` (a non-empty list of `{role, content}`), no `prompt`;
- `/v1/completions`: `prompt` (a string, or a list of token ids), no `messages`;
- `/v1/embeddings`: `input` (`check_input`), and only `EMBEDDING_KEYS` besides (model, user,
  dimensions, encoding_format): no sampling, an embedding server generates nothing;
- besides those (chat, completions), only `BODY_KEYS` (model, user, tools, ...) and `SAMPLING_KEYS` (OpenAI's sampling
  names, each type-checked); no `stream`;
- at most `MAX_BODY_BYTES` of JSON.

Plain dict work, no schema library: the producer runs this on hundreds of thousands of lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from .records import ENDPOINTS

__all__ = [
    "ALIASES",
    "BODY_KEYS",
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "EMBEDDING_KEYS",
    "MAX_BODY_BYTES",
    "SAMPLING_KEYS",
    "STREAM_REASON",
    "InvalidPrompt",
    "check_body",
    "check_input",
    "check_messages",
    "check_prompt",
    "check_sampling",
    "kind_mismatch",
]

CHAT, COMPLETIONS, EMBEDDINGS = ENDPOINTS  # the urls a request may have, by name

# A prompt's request body as JSON (and an input line) may not be larger than this. 10 MB prompts are
# a real use; a job that asks for more is refused rather than sent.
MAX_BODY_BYTES = 32 * 1024 * 1024


class InvalidPrompt(ValueError):
    """This request cannot be sent to a server; the message says why (a person can act on it)."""


# Unions made once: `int | float` in a call makes a new union object each time
_NUMBER = int | float
_STR_OR_LIST = str | list
_STR_OR_DICT = str | dict


def _num(v: Any) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# key -> (type check, what the check wants, for the message)
_Check = tuple[Callable[[Any], bool], str]
SAMPLING_KEYS: dict[str, _Check] = {
    "max_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "max_completion_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                              "a positive integer"),
    "min_tokens": (lambda v: _int(v) and v >= 0, "a non-negative integer"),
    "temperature": (lambda v: isinstance(v, _NUMBER) and not isinstance(v, bool) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (_int, "an integer (-1: off)"),
    "min_p": (lambda v: _num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "frequency_penalty": (_num, "a number"),
    "presence_penalty": (_num, "a number"),
    "repetition_penalty": (lambda v: _num(v) and v > 0, "a number > 0"),
    "stop": (_str_list, "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_int(t) for t in v), "a list of integers"),
    "seed": (_int, "an integer"),
    "n": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "logprobs": (lambda v: isinstance(v, bool) or (_int(v) and v >= 0), "true/false (chat) or an integer"),
    "top_logprobs": (lambda v: _int(v) and v >= 0, "a non-negative integer"),
    "response_format": (lambda v: isinstance(v, dict), "an object"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
}
# Accepted in a body besides the sampling keys and the prompt itself: they shape the request.
BODY_KEYS: dict[str, _Check] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "tools": (lambda v: isinstance(v, list), "a list"),
    "tool_choice": (lambda v: isinstance(v, _STR_OR_DICT), "a string or an object"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object"),
}
# An embedding body's keys besides `input` (OpenAI's; SGLang 0.5.23 `EmbeddingRequest` takes them).
EMBEDDING_KEYS: dict[str, _Check] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "dimensions": (lambda v: _int(v) and v > 0, "a positive integer"),
    "encoding_format": (lambda v: v in ("float", "base64"), '"float" or "base64"'),
}
_SPECS = {**SAMPLING_KEYS, **BODY_KEYS}  # every key a body may hold besides messages and prompt
# Other spellings an input line may use; a body as sent holds the canonical name only.
ALIASES = {"max_new_tokens": "max_tokens"}

# Why a line asking to stream is refused (the same words from the producer and the worker).
STREAM_REASON = ("stream is not used in batch: each result is collected whole and exported; drop \"stream\" "
                 "(or set it to false)")


def _shown(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()[:40]


def check_sampling(key: str, value: Any) -> str:
    """The canonical key name; raises InvalidPrompt for an unknown key or a value of the wrong type."""
    key = ALIASES.get(key, key)
    spec = SAMPLING_KEYS.get(key)
    if key == "stream":
        raise InvalidPrompt(STREAM_REASON)
    if spec is None:
        raise InvalidPrompt(f"unknown sampling key {key!r}")
    if not spec[0](value):
        raise InvalidPrompt(f"{key} must be {spec[1]}, got {_shown(value)}")
    return key


def check_messages(v: Any) -> None:
    if not isinstance(v, list) or not v:
        raise InvalidPrompt("messages must be a non-empty list")
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidPrompt(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        # content may be a list of parts (multimodal) or null on an assistant tool-call turn
        if not (isinstance(content, _STR_OR_LIST) or (content is None and m["role"] == "assistant")):
            raise InvalidPrompt(f"messages[{i}].content must be a string or a list of parts")


def check_prompt(v: Any) -> None:
    # /v1/completions also takes token ids; a list of strings would mean several prompts: refuse
    if not (isinstance(v, str) or (isinstance(v, list) and v and all(_int(t) for t in v))):
        raise InvalidPrompt("prompt must be a string (or a list of token ids)")


def check_input(v: Any) -> None:
    """An embedding request's `input`, as OpenAI takes it: a non-empty string, a non-empty list of
    non-empty strings, a non-empty list of token ids (one input), or a non-empty list of such lists."""
    if isinstance(v, str):
        if not v.strip():
            raise InvalidPrompt("input must not be empty or whitespace only")
        return
    if not isinstance(v, list) or not v:
        raise InvalidPrompt("input must be a string, a list of strings, or token ids (a list of integers, "
                            "or a list of such lists), not empty")
    first = v[0]
    if isinstance(first, str):
        for i, s in enumerate(v):
            if not isinstance(s, str) or not s.strip():
                raise InvalidPrompt(f"input[{i}] must be a non-empty string (input is a list of strings)")
    elif _int(first):
        if not all(_int(t) and t >= 0 for t in v):
            raise InvalidPrompt("input must be token ids: a list of non-negative integers")
    elif isinstance(first, list):
        for i, ids in enumerate(v):
            if not isinstance(ids, list) or not ids or not all(_int(t) and t >= 0 for t in ids):
                raise InvalidPrompt(f"input[{i}] must be a non-empty list of non-negative integers (token ids)")
    else:
        raise InvalidPrompt("input must be a string, a list of strings, or token ids (a list of integers, "
                            "or a list of such lists)")


def _check_embedding(body: dict[str, Any]) -> None:
    if "input" not in body:
        raise InvalidPrompt("a /v1/embeddings body has no input")
    check_input(body["input"])
    for key, value in body.items():
        if key == "input":
            continue
        spec = EMBEDDING_KEYS.get(key)
        if spec is None:
            if key == "stream":
                raise InvalidPrompt(STREAM_REASON)
            raise InvalidPrompt(f"{key!r} is not a /v1/embeddings key (it takes input, model, dimensions, "
                                "encoding_format, user)")
        if not spec[0](value):
            raise InvalidPrompt(f"{key} must be {spec[1]}, got {_shown(value)}")


def kind_mismatch(url: str, is_generation: bool | None) -> str | None:
    """Why a request to `url` cannot run on a server of this kind (`/model_info`'s is_generation; None:
    unknown, nothing said), or None when it can. An embedding server takes /v1/embeddings only, a
    generation server anything else: one kind per model."""
    if is_generation is None or (url == EMBEDDINGS) is not is_generation:
        return None
    if is_generation:
        return (f"{url} needs an embedding server, and the fleet's servers generate (/model_info is_generation "
                "true): start them with --is-embedding on an embedding model, or use a chat/completions run")
    return (f"{url} needs a generation server, and the fleet's servers embed (/model_info is_generation false, "
            "--is-embedding): they take /v1/embeddings requests only")


def check_body(url: Any, body: Any, *, size_bytes: int | None = None) -> None:
    """Raise InvalidPrompt unless `(url, body)` is a request batchfleet sends to a server as is.

    `size_bytes`: the body's (or its carrier's) encoded size when the caller knows it; else the body
    is encoded to measure it."""
    if not isinstance(url, str) or url not in ENDPOINTS:
        raise InvalidPrompt(f"unknown url {_shown(url)} (want {' or '.join(ENDPOINTS)})")
    if not isinstance(body, dict):
        raise InvalidPrompt("body must be an object")
    if url == EMBEDDINGS:
        _check_embedding(body)
    elif url == CHAT:
        if "prompt" in body:
            raise InvalidPrompt("a /v1/chat/completions body takes messages, not prompt")
        check_messages(body.get("messages"))
    else:
        if "messages" in body:
            raise InvalidPrompt("a /v1/completions body takes prompt, not messages")
        if "prompt" not in body:
            raise InvalidPrompt("body has no prompt")
        check_prompt(body["prompt"])
    for key, value in () if url == EMBEDDINGS else body.items():
        spec = _SPECS.get(key)
        if spec is None:
            if key in ("messages", "prompt"):
                continue
            if key == "stream":
                raise InvalidPrompt(STREAM_REASON)
            raise InvalidPrompt(f"unknown sampling key {key!r}")
        if not spec[0](value):
            raise InvalidPrompt(f"{key} must be {spec[1]}, got {_shown(value)}")
    size = len(orjson.dumps(body)) if size_bytes is None else size_bytes
    if size > MAX_BODY_BYTES:
        raise InvalidPrompt(f"request of {size:,} bytes is larger than the limit of {MAX_BODY_BYTES:,}")
