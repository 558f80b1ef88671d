"""Deterministic embeddings (public: tests recompute exports with `expected_embedding`).

The rule:
- An input's tokens are its words (`text.split()`), or for token ids their decimal spellings
  (`[7, 42]` is the token sequence `7 42`, the same as the text "7 42").
- The vector has `dimensions` entries (default: the model's hidden size). It is made of
  floor(dimensions / 2) pairs `(cos a_i, sin a_i) * sqrt(2 / dimensions)` and, when `dimensions` is
  odd, a last entry `+-1 / sqrt(dimensions)`. The angles are a_i = 2 pi (b_i + 0.5) / 256, the b_i the
  bytes of shake_256(adapter + NUL + the tokens joined by single spaces), UTF-8 (adapter "" for the
  base model); the sign of the odd entry is the low bit of the next byte. Every entry is rounded to
  float32, as a GPU returns them. So the vector is L2-normalised by construction (to float32
  rounding), differs per input and per LoRA adapter, and a Matryoshka truncation to m dimensions
  keeps the first m // 2 angles and is renormalised.
- base64 (`encoding_format: "base64"`) is the same float32 values, little-endian, contiguous.

Cost matters (a benchmark pushes a million short documents through 8 servers on 2 cores): a vector
is built from per-byte tables with C-level bytes operations (no per-entry Python arithmetic), about
10 us for 1024 dimensions, and its JSON text from per-pair fragments.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import sys
from array import array
from functools import lru_cache

__all__ = ["embedding_base64", "embedding_json", "embedding_tokens", "expected_embedding"]

_ANGLES = 256


def embedding_tokens(value: str | list[int]) -> list[str]:
    """The tokens of one input: the words of a text, or the decimal spellings of token ids."""
    if isinstance(value, str):
        return value.split()
    return [str(int(t)) for t in value]


class _Tables:
    """Per dimension count: the float32 bytes (8 per angle) and JSON text of each pair, by lane."""

    def __init__(self, dims: int) -> None:
        self.dims = dims
        self.pairs = dims // 2
        scale = math.sqrt(2.0 / dims)
        raw = [struct.pack("<2f", math.cos(2 * math.pi * (b + 0.5) / _ANGLES) * scale,
                           math.sin(2 * math.pi * (b + 0.5) / _ANGLES) * scale) for b in range(_ANGLES)]
        self.lanes = [bytes(raw[b][j] for b in range(_ANGLES)) for j in range(8)]  # byte j of each pair
        self.json = [",".join(map(repr, struct.unpack("<2f", raw[b]))).encode() for b in range(_ANGLES)]
        odd = 1.0 / math.sqrt(dims)
        self.odd = [struct.pack("<f", odd), struct.pack("<f", -odd)]
        self.odd_json = [repr(struct.unpack("<f", o)[0]).encode() for o in self.odd]

    def seed(self, tokens: list[str], adapter: str | None) -> bytes:
        key = f"{adapter or ''}\x00{' '.join(tokens)}".encode()
        return hashlib.shake_256(key).digest(self.pairs + (self.dims & 1))

    def float32_bytes(self, seed: bytes) -> bytes:
        buf = bytearray(8 * self.pairs)
        angles = seed[: self.pairs]
        for j, lane in enumerate(self.lanes):
            buf[j::8] = angles.translate(lane)
        if self.dims & 1:
            buf += self.odd[seed[self.pairs] & 1]
        return bytes(buf)

    def json_text(self, seed: bytes) -> bytes:
        body = b",".join(map(self.json.__getitem__, seed[: self.pairs]))
        if self.dims & 1:
            last = self.odd_json[seed[self.pairs] & 1]
            body = body + b"," + last if body else last
        return b"[" + body + b"]"


@lru_cache(maxsize=64)
def _tables(dims: int) -> _Tables:
    if dims < 1:
        raise ValueError("dimensions must be at least 1")
    return _Tables(dims)


def embedding_json(tokens: list[str], dims: int, adapter: str | None = None) -> bytes:
    """The vector as JSON text (a list of floats), as the server writes it."""
    t = _tables(dims)
    return t.json_text(t.seed(tokens, adapter))


def embedding_base64(tokens: list[str], dims: int, adapter: str | None = None) -> str:
    """The vector as base64 of little-endian float32 values (`encoding_format: "base64"`)."""
    t = _tables(dims)
    return base64.b64encode(t.float32_bytes(t.seed(tokens, adapter))).decode("ascii")


def expected_embedding(value: str | list[int], *, hidden_size: int = 1024, dimensions: int | None = None,
                       adapter: str | None = None) -> list[float]:
    """The vector the simulator returns for one input: `value` a text or a list of token ids,
    `hidden_size` the model's (the profile's `hidden_size`: 1024 for `embed-0.6b-96gb`, 256 for
    `tiny-embed`), `dimensions` the request's Matryoshka truncation, `adapter` its LoRA adapter
    name (None: the base model). Exactly equal (float by float) to what `/v1/embeddings` returns."""
    t = _tables(dimensions or hidden_size)
    out = array("f")
    out.frombytes(t.float32_bytes(t.seed(embedding_tokens(value), adapter)))
    if sys.byteorder == "big":
        out.byteswap()
    return out.tolist()
