"""The fleet's memory: what an earlier run verified as the best server spec, for the next run of the
same model on the same kind of GPU, SGLang version and server shape. Pure (the Redis hash
`Keys.MEMORY` is read and written by `run.py`).

A run whose move was verified (`verified` with a gain) remembers, per kind of server that moved:

    field: ["Qwen/Qwen3.6-27B", "NVIDIA RTX PRO 6000", 97887, "0.5.23", "tp1"]
           (model, GPU name, GPU memory MiB, SGLang version, shape: all from the workers' status records)
    value: {"spec": ServerSpec without its generation, "run", "ts", "ratio", "slots"}

A later run starts on it: as soon as its servers serve and say what they are, the supervisor writes
the remembered spec (the fleet spec when every server's kind remembers the same one, per-queue
overrides otherwise) with an event that names the run it comes from; it is not a canary (it was
verified), and the autopilot goes on watching and may move again. Anything missing from the key
(a GPU nvidia-smi does not name, a server that did not say its version) means no memory: never
applied to a server that may differ. `--fresh-start` ignores it. Records that do not decode are
skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson

from batchfleet.keys import Keys
from batchfleet.records import RecordError, ServerSpec, decode

from .classify import ServerView

__all__ = ["Remembered", "memory_field", "parse_memory"]

log = logging.getLogger("batchfleet.supervisor")


def memory_field(v: ServerView) -> str | None:
    """The memory's key for this server (`Keys.memory_field`), or None when any part of it is unknown."""
    return Keys.memory_field(v.model, v.gpu_name, v.gpu_memory_mib, v.facts.version if v.facts else "", v.shape)


def describe_field(key: str) -> str:
    try:
        model, gpu, mib, version, shape = orjson.loads(key)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return key[:120]
    return f"{model} on {gpu} ({mib / 1024:.0f} GiB), SGLang {version}, {shape}"


@dataclass(frozen=True, slots=True)
class Remembered:
    """One memory entry: the spec a run verified as best (its generation is the new run's to set)."""

    spec: ServerSpec
    run: str = ""
    ts: float = field(default_factory=time.time)
    ratio: float | None = None  # what the move was verified to gain, per server
    slots: list[int] = field(default_factory=list)

    def to_json(self) -> bytes:
        return orjson.dumps({**asdict(self), "spec": asdict(replace(self.spec, generation=0))})

    @classmethod
    def from_json(cls, raw: bytes | str) -> Remembered:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RecordError(f"memory entry: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise RecordError("memory entry: not a JSON object")
        spec = decode(ServerSpec, data.get("spec"))
        rest = {k: v for k, v in data.items() if k in ("run", "ts", "ratio", "slots")}
        try:
            return cls(spec=replace(spec, generation=0), **rest)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"memory entry: {exc}") from None


def parse_memory(raw: Mapping[bytes | str, bytes | str]) -> dict[str, Remembered]:
    """The memory hash as read from Redis; entries that do not decode are skipped (said once)."""
    out: dict[str, Remembered] = {}
    for k, v in raw.items():
        key = k.decode() if isinstance(k, bytes) else k
        try:
            out[key] = Remembered.from_json(v)
        except RecordError as exc:
            log.warning("skipping the fleet's memory entry %s: %s", key[:120], exc)
    return out


def remembered_data(entry: Remembered) -> dict[str, Any]:
    return {"spec": asdict(entry.spec), "run": entry.run, "ts": entry.ts, "ratio": entry.ratio, "slots": entry.slots}
