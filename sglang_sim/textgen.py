"""Deterministic "generation": tokenization rule, chat template and the output text of a request.

Rules (tests recompute them through the public functions here):
- A token is a whitespace-separated word: `count_tokens(text) = max(1, len(text.split()))`.
- Chat messages become one prompt string with `render_chat` (a ChatML-like template).
- The output is a sequence of words drawn from a fixed vocabulary by a PRNG seeded with
  sha256(prompt + canonical sampling parameters), so the same prompt and parameters always give
  the same text, and a different temperature/seed gives a different one.
- Each (prompt, params) has a natural length (exponential-ish, mean ~256 words, at least 4):
  if it is <= max_new_tokens the request finishes with "stop" (EOS), else with "length" after
  max_new_tokens words. `ignore_eos` always runs to max_new_tokens; `min_new_tokens` lengthens.
- `stop` strings: the text is cut before the first occurrence of any of them ("stop", matched).
- A LoRA adapter changes the output: its name joins the seed (the base model's seed is unchanged).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

__all__ = [
    "ACCEPTED_SAMPLING_KEYS", "count_tokens", "expected_completion", "generate", "render_chat", "token_ids",
]

ACCEPTED_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "sampling_seed", "logit_bias", "thinking_budget",
})

# Parameters that change what is sampled; the others (e.g. max_new_tokens) only cut it.
_SEED_KEYS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
              "repetition_penalty", "sampling_seed", "json_schema", "regex")

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "gu", "fe", "ho", "ba", "ri"]
VOCAB = [a + b + c for a in _SYLLABLES for b in _SYLLABLES[:4] for c in ("", "n", "s", "l")]
_VOCAB_ID = {w: i + 1000 for i, w in enumerate(VOCAB)}
EOS_MEAN_WORDS = 256


def count_tokens(text: str) -> int:
    """Prompt tokens of `text`: whitespace-separated words, at least 1."""
    return max(1, len(text.split()))


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The prompt string a chat request is rendered to (ChatML-like, with the assistant opener)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{content or ''}<|im_end|>")
    parts.append("<|im_start|>assistant\n")
    return "\n".join(parts)


def _rng(prompt: str, params: dict[str, Any], index: int, adapter: str | None) -> random.Random:
    key = {k: params.get(k) for k in _SEED_KEYS if params.get(k) is not None}
    blob = prompt + "\x00" + json.dumps(key, sort_keys=True, default=str) + f"\x00{index}"
    if adapter is not None:
        blob += f"\x00lora:{adapter}"
    return random.Random(int.from_bytes(hashlib.sha256(blob.encode()).digest()[:8], "big"))


def generate(prompt: str, sampling_params: dict[str, Any], *, index: int = 0, default_max_new_tokens: int = 128,
             adapter: str | None = None) -> tuple[list[str], str, str | None]:
    """(output words, finish_reason "stop"|"length", matched stop string or None); `adapter` the LoRA
    adapter's name (None: the base model)."""
    p = sampling_params or {}
    max_new = p.get("max_new_tokens")
    max_new = default_max_new_tokens if max_new is None else int(max_new)
    rng = _rng(prompt, p, index, adapter)
    natural = 4 + int(-EOS_MEAN_WORDS * math.log(1.0 - rng.random()))
    natural = max(natural, int(p.get("min_new_tokens") or 0))
    if p.get("ignore_eos"):
        natural = max_new + 1
    n = min(natural, max_new)
    words = [VOCAB[rng.randrange(len(VOCAB))] for _ in range(n)]
    finish = "stop" if natural <= max_new else "length"
    stops = p.get("stop")
    stops = [stops] if isinstance(stops, str) else list(stops or [])
    text = " ".join(words)
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s) if s else -1
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is not None:
        words = text[: best[0]].split()
        return words, "stop", best[1]
    return words, finish, None


def expected_completion(prompt: str, sampling_params: dict[str, Any] | None = None, *,
                        index: int = 0, adapter: str | None = None) -> tuple[str, int, str]:
    """(text, completion_tokens, finish_reason) the simulator returns for this prompt and params.

    Same rule on /generate, /v1/completions and /v1/chat/completions (chat: prompt=render_chat(messages),
    max_new_tokens = max_tokens). `index` is the choice number when n > 1; `adapter` the LoRA adapter
    the request ran on (its name; None for the base model).
    """
    words, finish, _ = generate(prompt, sampling_params or {}, index=index, adapter=adapter)
    return " ".join(words), len(words), finish


def token_ids(words: list[str]) -> list[int]:
    """Token ids of output words (vocabulary index + 1000, as if special tokens came first)."""
    return [_VOCAB_ID.get(w, 3) for w in words]
