"""One input line -> (custom_id, url, body), or `Reject` with a reason a person can act on.

Two line formats are accepted:

- OpenAI batch input: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions", "body": {"messages": [...]} | {"prompt": ...}}`; the body is sent as is.
- Simple: `{"id" | "custom_id", "prompt": str | "messages": [{role, content}], <sampling>...}`,
  sampling parameters at top level or under `sampling_params`. `prompt` -> `/v1/completions`,
  `messages` -> `/v1/chat/completions`.

Sampling keys are an explicit allow-list (the OpenAI names SGLang's OpenAI endpoints take): a
misspelled `temprature` is rejected rather than silently ignored by the server. Per-file defaults
(from the command line) fill keys a line did not set. This runs once per line on hundreds of
thousands of lines, so it is plain dict work, no schema library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from batchfleet.records import ENDPOINTS

__all__ = ["SAMPLING_KEYS", "Reject", "check_sampling", "parse_line", "parse_param"]

CHAT, COMPLETIONS = ENDPOINTS


class Reject(ValueError):
    """This line cannot become a prompt; the message says why."""


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# key -> (type check, what the check wants, for the message)
_Check = tuple[Callable[[Any], bool], str]
SAMPLING_KEYS: dict[str, _Check] = {
    "max_tokens": (lambda v: _int(v) and v > 0, "a positive integer"),
    "max_completion_tokens": (lambda v: _int(v) and v > 0, "a positive integer"),
    "min_tokens": (lambda v: _int(v) and v >= 0, "a non-negative integer"),
    "temperature": (lambda v: _num(v) and v >= 0, "a number >= 0"),
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
# Accepted in a batch body besides the sampling keys: they shape the request, not the sampling.
_BODY_KEYS = frozenset({"model", "messages", "prompt", "user", "tools", "tool_choice", "logit_bias"})
_SIMPLE_KEYS = frozenset({"id", "custom_id", "prompt", "messages", "sampling_params", "model"})
_ALIASES = {"max_new_tokens": "max_tokens"}


def check_sampling(key: str, value: Any) -> str:
    """The canonical key name; raises Reject for an unknown key or a value of the wrong type."""
    key = _ALIASES.get(key, key)
    spec = SAMPLING_KEYS.get(key)
    if spec is None:
        raise Reject(f"unknown sampling key {key!r}")
    if not spec[0](value):
        raise Reject(f"{key} must be {spec[1]}, got {orjson.dumps(value).decode()[:40]}")
    return key


def parse_param(text: str) -> tuple[str, Any]:
    """`--param KEY=VALUE`: VALUE is JSON when it parses (numbers, true, lists), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise Reject(f"--param wants KEY=VALUE, got {text!r}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw
    return check_sampling(key.strip(), value), value


def _messages(v: Any) -> None:
    if not isinstance(v, list) or not v:
        raise Reject("messages must be a non-empty list")
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Reject(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        # content may be a list of parts (multimodal) or null on an assistant tool-call turn
        if not (isinstance(content, str | list) or (content is None and m["role"] == "assistant")):
            raise Reject(f"messages[{i}].content must be a string or a list of parts")


def _prompt(v: Any) -> None:
    # /v1/completions also takes token ids; a list of strings would mean several prompts: refuse
    if not (isinstance(v, str) or (isinstance(v, list) and v and all(_int(t) for t in v))):
        raise Reject("prompt must be a string (or a list of token ids)")


def _cid(d: dict[str, Any], *names: str) -> str:
    for name in names:
        if name in d:
            v = d[name]
            if isinstance(v, bool) or not isinstance(v, str | int):
                raise Reject(f"{name} must be a string or an integer")
            cid = str(v)
            if not cid.strip():
                raise Reject(f"{name} is empty")
            return cid
    raise Reject(f"no {' or '.join(names)}")


def _fill(body: dict[str, Any], sampling: dict[str, Any], defaults: dict[str, Any], model: str) -> None:
    for k, v in sampling.items():
        body[check_sampling(k, v)] = v
    for k, v in defaults.items():
        body.setdefault(k, v)
    body.setdefault("model", model)


def parse_line(raw: bytes | str, defaults: dict[str, Any], model: str) -> tuple[str, str, dict[str, Any]]:
    """Parse one line into (custom_id, url, body). `defaults` are already-checked sampling values."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Reject(f"not JSON ({exc.args[0].split(':')[0]})") from None
    if not isinstance(d, dict):
        raise Reject(f"not a JSON object (a {type(d).__name__})")
    if "body" in d or "url" in d or "method" in d:
        return _parse_batch(d, defaults, model)
    return _parse_simple(d, defaults, model)


def _parse_batch(d: dict[str, Any], defaults: dict[str, Any], model: str) -> tuple[str, str, dict[str, Any]]:
    cid = _cid(d, "custom_id")
    if d.get("method", "POST") != "POST":
        raise Reject(f"method must be POST, got {d.get('method')!r}")
    url = d.get("url")
    if url not in ENDPOINTS:
        raise Reject(f"unknown url {url!r} (want {' or '.join(ENDPOINTS)})")
    body = d.get("body")
    if not isinstance(body, dict):
        raise Reject("body must be an object")
    if url == CHAT:
        if "prompt" in body:
            raise Reject("a /v1/chat/completions body takes messages, not prompt")
        _messages(body.get("messages"))
    else:
        if "messages" in body:
            raise Reject("a /v1/completions body takes prompt, not messages")
        if "prompt" not in body:
            raise Reject("body has no prompt")
        _prompt(body["prompt"])
    if body.get("stream"):
        raise Reject("stream=true is not supported in a batch")
    out: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for k, v in body.items():
        if k in _BODY_KEYS:
            out[k] = v
        elif k != "stream":
            sampling[k] = v
    if "max_tokens" in sampling and "max_new_tokens" in sampling:
        raise Reject("both max_tokens and max_new_tokens")
    _fill(out, sampling, defaults, model)
    return cid, url, out


def _parse_simple(d: dict[str, Any], defaults: dict[str, Any], model: str) -> tuple[str, str, dict[str, Any]]:
    cid = _cid(d, "custom_id", "id")
    has_prompt, has_messages = "prompt" in d, "messages" in d
    if has_prompt == has_messages:
        raise Reject("both prompt and messages" if has_prompt else "no prompt or messages")
    sampling = {k: v for k, v in d.items() if k not in _SIMPLE_KEYS}
    nested = d.get("sampling_params", {})
    if not isinstance(nested, dict):
        raise Reject("sampling_params must be an object")
    for k, v in nested.items():
        if k in sampling or _ALIASES.get(k, k) in sampling:
            raise Reject(f"{k} given both at top level and in sampling_params")
        sampling[k] = v
    if ("max_tokens" in sampling) and ("max_new_tokens" in sampling):
        raise Reject("both max_tokens and max_new_tokens")
    body: dict[str, Any]
    if has_prompt:
        p = d["prompt"]
        if not isinstance(p, str) or not p:
            raise Reject("prompt must be a non-empty string")
        url, body = COMPLETIONS, {"prompt": p}
    else:
        _messages(d["messages"])
        url, body = CHAT, {"messages": d["messages"]}
    if "model" in d:
        if not isinstance(d["model"], str):
            raise Reject("model must be a string")
        body["model"] = d["model"]
    _fill(body, sampling, defaults, model)
    return cid, url, body
