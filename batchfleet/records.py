"""The records that travel through Redis, and their one JSON encoding.

- `Prompt`: the single argument of every RQ job (`jobs.GENERATE`); made by the producer.
- `Result`: one per finished prompt, success or final failure; workers append it to the results
  stream, the collector stores it, `producer export` writes it as an OpenAI batch output line.
- `WorkerStatus`: what each worker publishes every few seconds; the supervisor reads only these.
- `Event`: a decision or restart, for `supervisor watch` and the audit trail.
- `ServerSpec`: the server configuration the supervisor wants, with its generation number
  (`Keys.control`: field `fleet` for every worker, `worker:<name>` to override one, e.g. a canary).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

__all__ = ["ENDPOINTS", "Event", "Prompt", "Result", "ServerMetrics", "ServerSpec", "WorkerStatus", "job_id_for"]

# The OpenAI batch `url`s batchfleet serves, each the same path on an SGLang server.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def job_id_for(run: str, cid: str) -> str:
    """The RQ job id of a prompt: the same custom_id in the same run is always the same job, which
    is what makes enqueueing idempotent. Hashed so any custom_id (long, odd characters) is safe."""
    return "bf-" + hashlib.blake2b(f"{run}\0{cid}".encode(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Prompt:
    cid: str  # the user's custom_id
    seq: int  # position in the run, so the export keeps input order
    url: str  # one of ENDPOINTS
    body: dict[str, Any]  # the OpenAI request body, sent as is
    src: str = ""  # "file:line", for messages
    run: str = ""  # the run it belongs to: its result goes to that run's stream, so a worker checks it

    def to_dict(self) -> dict[str, Any]:
        d = {"cid": self.cid, "seq": self.seq, "url": self.url, "body": self.body, "src": self.src}
        if self.run:
            d["run"] = self.run
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prompt:
        return cls(cid=d["cid"], seq=int(d["seq"]), url=d["url"], body=d["body"], src=d.get("src", ""),
                   run=d.get("run", ""))


@dataclass(frozen=True, slots=True)
class Result:
    cid: str
    jid: str  # the RQ job id
    seq: int
    status_code: int  # HTTP status of the final answer (0: no answer at all)
    body: dict[str, Any] | None = None  # the server's reply when it succeeded
    error: dict[str, str] | None = None  # {"code", "message"} when it failed for good
    worker: str = ""
    attempts: int = 1
    finished_at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def completion_tokens(self) -> int:
        usage = (self.body or {}).get("usage") or {}
        return int(usage.get("completion_tokens") or 0)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Result:
        return cls(**orjson.loads(raw))

    def batch_output_line(self) -> dict[str, Any]:
        """The OpenAI batch output shape: one of these per prompt in the export."""
        response = None
        if self.body is not None:
            response = {"status_code": self.status_code, "request_id": self.jid, "body": self.body}
        elif self.status_code:
            response = {"status_code": self.status_code, "request_id": self.jid, "body": None}
        return {"id": f"batch_req_{self.jid}", "custom_id": self.cid, "response": response, "error": self.error}


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """What a worker scrapes from its server's `/metrics` (None: the server did not say)."""

    running: float | None = None
    queued: float | None = None
    full_kv_usage: float | None = None
    mamba_usage: float | None = None
    token_usage: float | None = None
    cache_hit_rate: float | None = None
    gen_throughput: float | None = None
    retracted: float | None = None  # sglang:num_retracted_requests_total
    generation_tokens_total: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker: str
    host: str
    queue: str
    gpu: int | None
    state: str  # starting | serving | draining | restarting | down
    server_url: str = ""
    strategy: str = "default"
    server_flags: list[str] = field(default_factory=list)
    generation: int = 0  # the control generation this worker's server runs
    effective_max: int = 0
    in_flight: int = 0
    done: int = 0
    failed: int = 0
    tokens_per_s: float = 0.0  # completion tokens/s measured by the worker over its last window
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    message: str = ""
    ts: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerStatus:
        d = orjson.loads(raw)
        d["metrics"] = ServerMetrics(**d.get("metrics") or {})
        return cls(**d)


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What may change between two starts of a GPU's server: the supervisor's knobs. A worker whose
    server runs another generation than the one asked of it restarts it (drain, stop, check the GPU
    is free, start, rediscover capacity, resume)."""

    generation: int = 0
    strategy: str = "default"  # one of config.STRATEGIES
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ServerSpec:
        return cls(**orjson.loads(raw))

    def describe(self) -> str:
        parts = [self.strategy]
        if self.mem_fraction_static is not None:
            parts.append(f"mem {self.mem_fraction_static:g}")
        if self.max_running_requests is not None:
            parts.append(f"max {self.max_running_requests}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # e.g. decision, restart, canary, rollback, server_start_failed
    message: str
    source: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Event:
        return cls(**orjson.loads(raw))
