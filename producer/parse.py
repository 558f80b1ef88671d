"""One input line -> (custom_id, url, body), or `Reject` with a reason a person can act on.

Two line formats are accepted:

- OpenAI batch input: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions" | "/v1/embeddings", "body": {"messages": [...]} | {"prompt": ...} | {"input": ...}}`;
  the body is sent as is.
- Simple: `{"id" | "custom_id", "prompt": str | "messages": [{role, content}], <sampling>...}`,
  sampling parameters at top level or under `sampling_params`. `prompt` -> `/v1/completions`,
  `messages` -> `/v1/chat/completions`; `input` (with `dimensions`, `encoding_format` at top level)
  -> `/v1/embeddings`.

A LoRA adapter is named as SGLang 0.5.23's OpenAI endpoints take it (`serving_base.py`
`_parse_model_parameter`, `_resolve_lora_path`): `model: "<base>:<adapter>"` (split at the first `:`;
`"<base>:"` is the base model) or `lora_path: "<adapter>"` (top level, or in the batch form's body); the
model's suffix wins over lora_path. Both are stored in one form, `model: "<base>:<adapter>"` and no
lora_path (`_name_adapter`), so the fingerprint and dedup agree whichever a line used; the body is sent so.

Sampling keys are an explicit allow-list (the OpenAI names SGLang's OpenAI endpoints take): a
misspelled `temprature` is rejected rather than silently ignored by the server. Per-file defaults
(from the command line) fill keys a line did not set. This runs once per line on hundreds of
thousands of lines, so it is plain dict work, no schema library.
"""

from __future__ import annotations

from typing import Any

import orjson

from batchfleet.prompts import (
    ALIASES,
    BODY_KEYS,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    SAMPLING_KEYS,
    STREAM_REASON,
    InvalidPrompt,
    check_body,
    check_messages,
    check_sampling,
)
from batchfleet.records import ENDPOINTS

__all__ = ["SAMPLING_KEYS", "NotJson", "Reject", "adapter_of", "check_sampling", "parse_line", "parse_param"]

# This line cannot become a prompt; the message says why. The same class the worker refuses a job
# with: the rules live in `batchfleet.prompts`, shared by both.
Reject = InvalidPrompt


class NotJson(Reject):
    """The line is not a JSON object at all: its text is wrong, before any rule of a request."""


# Accepted in a batch body besides the sampling keys: they shape the request, not the sampling.
_BODY_KEYS = frozenset({"messages", "prompt", *BODY_KEYS})
_BATCH_KEYS = frozenset({"custom_id", "method", "url", "body"})
_PLAIN_KEYS = frozenset({*_BODY_KEYS, *SAMPLING_KEYS})  # a body of these needs no sorting out (check_body checks it)
_NONE: dict[str, Any] = {}  # no sampling_params (never written to)
_SIMPLE_KEYS = frozenset({"id", "custom_id", "prompt", "messages", "sampling_params", "model", "lora_path"})
_ALIASES = ALIASES


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


def _cid(d: dict[str, Any], *names: str) -> str:
    for name in names:
        if name in d:
            v = d[name]
            if isinstance(v, str):
                cid = v
            elif isinstance(v, int) and not isinstance(v, bool):
                cid = str(v)
            else:
                raise Reject(f"{name} must be a string or an integer")
            if not cid or cid.isspace():
                raise Reject(f"{name} is empty")
            return cid
    raise Reject(f"no {' or '.join(names)}")


def adapter_of(body: dict[str, Any]) -> str | None:
    """The LoRA adapter a stored body runs on (`model: "<base>:<adapter>"`), None: the base model."""
    model = body.get("model")
    if not isinstance(model, str) or ":" not in model:
        return None
    return model.split(":", 1)[1] or None


def _name_adapter(body: dict[str, Any], lora: Any, model: str) -> None:
    """The one stored form of a LoRA request: `model: "<base>:<adapter>"`, no lora_path (module doc)."""
    m = body["model"]
    if lora is not None and not isinstance(lora, str):
        raise Reject("lora_path must be a string: the name of one LoRA adapter (BATCHFLEET_LORA_PATHS)")
    if not isinstance(m, str):
        return  # check_body refuses it
    base, colon, adapter = m.partition(":")
    adapter = adapter.strip() if colon else ""
    if not adapter and lora:
        adapter = lora.strip()
    base = base.strip() or model
    body["model"] = f"{base}:{adapter}" if adapter else base


def _fill(body: dict[str, Any], sampling: dict[str, Any], defaults: dict[str, Any], model: str,
          lora: Any = None) -> None:
    """Put the line's sampling keys (by their canonical names), the defaults and the model into `body`
    (an adapter named by `lora`, the line's lora_path, or the model: in its stored form). A key that is
    no sampling key is refused here; the values are checked by `check_body`, once."""
    for k, v in sampling.items():
        key = _ALIASES.get(k, k)
        if key not in SAMPLING_KEYS:
            check_sampling(k, v)  # raises: an unknown key (also a body key given as sampling) or stream
        body[key] = v
    for k, v in defaults.items():
        body.setdefault(k, v)
    m = body.setdefault("model", model)
    if lora is not None or (type(m) is str and ":" in m):
        _name_adapter(body, lora, model)


def parse_line(raw: bytes | str, defaults: dict[str, Any], model: str, *,
               batch_only: bool = False) -> tuple[str, str, dict[str, Any]]:
    """Parse one line into (custom_id, url, body). `defaults` are already-checked sampling values.
    The body returned passes `batchfleet.prompts.check_body`, the check every worker applies.
    `batch_only`: the simple form is refused (the OpenAI Batch API's input takes the batch form only)."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise NotJson(f"not JSON ({exc.args[0].split(':')[0]})") from None
    if not isinstance(d, dict):
        raise NotJson(f"not a JSON object (a {type(d).__name__})")
    if "body" in d or "url" in d or "method" in d:
        cid, url, body = _parse_batch(d, defaults, model)
    elif batch_only:
        raise Reject("not a batch request: a line holds custom_id, method, url and body")
    else:
        cid, url, body = _parse_simple(d, defaults, model)
    check_body(url, body, size_bytes=len(raw))
    return cid, url, body


def _parse_batch(d: dict[str, Any], defaults: dict[str, Any], model: str) -> tuple[str, str, dict[str, Any]]:
    if not _BATCH_KEYS.issuperset(d):  # like the simple form, which rejects an unknown key as an unknown sampling key
        unknown = sorted(k for k in d if k not in _BATCH_KEYS)
        raise Reject(f"unknown key {unknown[0]!r} in a batch-form line (it takes custom_id, method, url, body; "
                     "sampling parameters go inside body)")
    cid = _cid(d, "custom_id")
    if d.get("method", "POST") != "POST":
        raise Reject(f"method must be POST, got {d.get('method')!r}")
    url = d.get("url")
    if url not in ENDPOINTS:
        raise Reject(f"unknown url {url!r} (want {' or '.join(ENDPOINTS)})")
    body = d.get("body")
    if not isinstance(body, dict):
        raise Reject("body must be an object")
    if body.get("stream"):
        raise Reject(STREAM_REASON)
    if url == EMBEDDINGS:  # no sampling: the body as it is (check_body holds it to the embedding keys)
        out = dict(body)
        _fill(out, {}, defaults, model)
        return cid, url, out
    if _PLAIN_KEYS.issuperset(body):  # every key by its own name, no alias, no stream: the body as it is
        out = dict(body)
        _fill(out, {}, defaults, model)
        return cid, url, out
    out: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for k, v in body.items():
        if k in _BODY_KEYS:
            out[k] = v
        elif k != "stream" and k != "lora_path":
            sampling[k] = v
    if "max_tokens" in sampling and "max_new_tokens" in sampling:
        raise Reject("both max_tokens and max_new_tokens")
    _fill(out, sampling, defaults, model, body.get("lora_path"))
    return cid, url, out


def _parse_simple(d: dict[str, Any], defaults: dict[str, Any], model: str) -> tuple[str, str, dict[str, Any]]:
    cid = _cid(d, "custom_id", "id")
    if "input" in d and "prompt" not in d and "messages" not in d:
        body = {k: v for k, v in d.items() if k not in ("id", "custom_id")}
        _fill(body, {}, defaults, model)
        return cid, EMBEDDINGS, body
    has_prompt, has_messages = "prompt" in d, "messages" in d
    if has_prompt == has_messages:
        raise Reject("both prompt and messages" if has_prompt else "no prompt or messages")
    sampling = {k: v for k, v in d.items() if k not in _SIMPLE_KEYS}
    nested = d.get("sampling_params", _NONE)
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
        check_messages(d["messages"])
        url, body = CHAT, {"messages": d["messages"]}
    if "model" in d:
        if not isinstance(d["model"], str):
            raise Reject("model must be a string")
        body["model"] = d["model"]
    _fill(body, sampling, defaults, model, d.get("lora_path"))
    return cid, url, body
