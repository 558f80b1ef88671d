"""The records that travel through Redis, and their one JSON encoding.

- `Prompt`: the single argument of every RQ job (`jobs.GENERATE`); made by the producer.
- `Result`: one per finished prompt, success or final failure; workers append it to the results
  stream, the collector stores it, `producer export` writes it as an OpenAI batch output line.
- `WorkerStatus`: what each worker publishes every few seconds; the supervisor reads only these.
  Its `facts` (`ServerFacts`) are what the server said about itself at start-up: pool sizes, the
  cap and what caused it; they do not change while the server lives.
- `Event`: a decision or restart (`EventKind`), for `supervisor watch` and the audit trail.
- `TenantFigures`: what the head of a shared fleet knows of one tenant's share (`Keys.tenants`).
- `ServerSpec`: the server configuration the supervisor wants, with its generation number
  (`Keys.control`: field `fleet` for every worker, `queue:<queue>` to override one GPU, e.g. a canary;
  keyed by queue, not worker name, so a restarted worker finds what was asked of its GPU).

Every closed set of values a record carries is a StrEnum (`WorkerState`, `Strategy`, `CapCause`,
`EventKind`); on the wire it is its value, a plain string. A record built in this process holds
members (a string given for such a field is turned into its member, or refused). Decoding a record
another process wrote is `codec.decode`'s (re-exported here as `decode`); a job's envelope around its
`Prompt` is `batchfleet.jobs`'.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from .codec import REFUSE_UNKNOWN, decode, enum_members, loads
from .errors import RecordError
from .redact import redact_argv

__all__ = [
    "ENDPOINTS",
    "STRATEGIES",
    "CapCause",
    "Event",
    "EventKind",
    "Prompt",
    "RecordError",
    "Result",
    "ServerFacts",
    "ServerMetrics",
    "ServerSpec",
    "Strategy",
    "TenantFigures",
    "WorkerState",
    "WorkerStatus",
    "decode",
]


class Strategy(StrEnum):
    """The mamba strategies batchfleet knows, in the order the supervisor climbs them. DEFAULT sends
    no strategy flag at all (the server's own `auto`); NO_RADIX disables the radix cache, which
    removes the per-request slot overhead altogether."""

    DEFAULT = "default"
    EXTRA_BUFFER = "extra_buffer"
    EXTRA_BUFFER_LAZY = "extra_buffer_lazy"
    NO_BUFFER = "no_buffer"
    NO_RADIX = "no_radix"
    UNKNOWN = "unknown"  # a worker's report names one this version does not know; never asked of a server


# The strategies a server can be asked to run (the CLI's choices, the allow-list of a ServerSpec).
STRATEGIES = tuple(s.value for s in Strategy if s is not Strategy.UNKNOWN)

# What a ServerSpec may ask of a server: anything outside is refused, whoever wrote it to Redis.
MEM_FRACTION_RANGE = (0.3, 0.98)
MAX_RUNNING_RANGE = (1, 4096)


class WorkerState(StrEnum):
    """A worker's server, as its status record says (the values are what travels in JSON)."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    RESTARTING = "restarting"
    DOWN = "down"
    FAILED = "failed"  # its server could not start (or stayed sick) N times in a row: the GPU takes no work
    UNKNOWN = "unknown"  # a state this version does not know (a newer worker's): the rest of its record holds


class EventKind(StrEnum):
    """What an `Event` records."""

    RESTARTED = "restarted"  # a worker's server serves a new generation (data: downtime, handed back)
    SPEC_REFUSED = "spec_refused"  # a worker refused a server spec read from Redis
    SHUTDOWN_COMMAND = "shutdown_command"  # a worker drains and exits on RQ's shutdown command
    GPU_FAILED = "gpu_failed"  # a worker marked its GPU failed (data: reason); it takes no work
    SERVER_SICK = "server_sick"  # a worker's server failed many prompts in a row and its probe: restarted
    DIAGNOSIS = "diagnosis"  # the autopilot's reading of a server that entered a problem class
    STALL = "stall"  # the fleet is mamba-bound
    DECISION = "decision"  # the autopilot decided (or decided not) to move
    ADVICE = "advice"  # what it would do, under --dry-run
    CANARY = "canary"  # a canary started, gained, or ended
    ROLLOUT = "rollout"  # one more server moves to the new spec
    ROLLED_OUT = "rolled_out"  # the new spec is the fleet's
    VERIFIED = "verified"  # the fleet measured after a rollout
    ROLLBACK = "rollback"
    MANUAL = "manual"  # `supervisor restart`
    UNKNOWN = "unknown"  # a kind this version does not know (a newer process wrote it)


# The OpenAI batch `url`s batchfleet serves, each the same path on an SGLang server. Append only: the
# store keeps a prompt's url as its index here.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass(frozen=True, slots=True)
class Prompt:
    cid: str  # the user's custom_id
    seq: int  # position in the run, so the export keeps input order
    url: str  # one of ENDPOINTS
    body: dict[str, Any]  # the OpenAI request body, sent as is
    src: str = ""  # "file:line", for messages
    run: str = ""  # the run it belongs to: its result goes to that run's stream, so a worker checks it
    fp: str = ""  # the request's fingerprint (hex, from the store): its Result echoes it, see Result.fp
    pri: int = 0  # 1: a shared fleet's high-priority batch (sent with a request priority, see worker.runner)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prompt:
        return decode(cls, d)


@dataclass(frozen=True, slots=True)
class Result:
    cid: str
    jid: str  # the RQ job id
    seq: int
    status_code: int  # HTTP status of the final answer (0: no answer at all)
    body: dict[str, Any] | None = None  # the server's JSON reply: the answer, or its error body
    error: dict[str, str] | None = None  # {"code", "message"} when it failed for good
    worker: str = ""
    attempts: int = 1
    finished_at: float = field(default_factory=time.time)
    # The fingerprint of the request that was sent (the Prompt's `fp`): the collector refuses a result
    # whose request the store no longer holds (`enqueue --rerun-changed` replaced it; same job id).
    fp: str = ""
    # An embedding's answer as the server sent it: its JSON text (an object, on one line), carried unparsed,
    # with `body` None. Its vectors are ~20 KB of JSON an input: the worker parses them once (to read
    # `usage` and check the answer is an object), the collector and the export never (`batch_output_line`
    # writes this text as the line's body, byte for byte). "" in any other result, and from older workers.
    raw_body: str = ""

    def __post_init__(self) -> None:
        raw = self.raw_body
        if raw and (self.body is not None or raw[:1] != "{" or raw[-1:] != "}" or "\n" in raw or "\r" in raw):
            raise ValueError("raw_body must be a JSON object on one line, and body then None")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def completion_tokens(self) -> int:
        usage = (self.body or {}).get("usage") or {}
        return int(usage.get("completion_tokens") or 0)

    def to_json(self) -> bytes:
        return orjson.dumps(self)  # orjson encodes a dataclass natively, as asdict would, without the deep copy

    @classmethod
    def from_json(cls, raw: bytes | str) -> Result:
        return loads(cls, raw)

    def batch_output_line(self) -> dict[str, Any]:
        """One line of OpenAI's batch output (or error) file. A request that got an HTTP answer has it
        in `response` (`status_code`, `request_id`, `body`: the answer's JSON body, an error's too) and
        `error` null; `error` (`code`, `message`) is for one that got no usable answer (no answer at
        all, or a 200 that was not JSON), with `response` null. A `raw_body` is the body as an
        `orjson.Fragment`: the line is for `orjson.dumps`."""
        answered = self.error is None or (100 <= self.status_code <= 599 and self.status_code != 200)
        if not answered:
            return {"id": f"batch_req_{self.jid}", "custom_id": self.cid, "response": None, "error": self.error}
        body: Any = orjson.Fragment(self.raw_body) if self.raw_body else self.body  # raw: for orjson.dumps, as is
        if body is None and self.error is not None:  # the server's error answer was not a JSON object
            body = {"error": {"message": self.error.get("message", "")}}
        return {"id": f"batch_req_{self.jid}", "custom_id": self.cid,
                "response": {"status_code": self.status_code, "request_id": self.jid, "body": body}, "error": None}


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
    prompt_tokens_total: float | None = None  # sglang:prompt_tokens_total: prompt tokens of finished requests
    cached_tokens_total: float | None = None  # sglang:cached_tokens_total: of them, taken from the radix cache
    ts: float | None = None  # when the worker scraped these (its clock): rates pair a counter with this


class CapCause(StrEnum):
    """What caps a server's concurrency, as its start-up sizing decided (`ServerFacts.cap_cause`)."""

    MAMBA = "mamba"  # the mamba state pool
    KV = "kv"  # the KV pool
    REQUESTED = "requested"  # --max-running-requests
    UNKNOWN = ""  # the server did not say, or said what this version does not know


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What a server said about itself when it started (`/server_info` and its start-up log): static
    for the server's life. None: the server did not say. Sums over data-parallel ranks."""

    effective_max_running: int = 0
    requested_max_running: int | None = None  # --max-running-requests as asked (top-level server_info)
    cap_cause: CapCause = CapCause.UNKNOWN
    mamba_pool: int | None = None  # max_mamba_cache_size: state slots
    slots_per_request: int | None = None  # mamba state slots reserved per running request (5, 4, 3, 1)
    max_total_num_tokens: int | None = None  # the KV pool, in tokens
    context_len: int | None = None
    # The mamba strategy the server resolved (auto -> extra_buffer / no_buffer): SGLang's word, not one
    # of batchfleet's rungs (`Strategy`), so a plain string.
    strategy: str = ""
    radix_cache: bool = True
    mem_fraction_static: float | None = None  # as resolved by the server
    memory_before_load_gb: float | None = None  # GPU memory free before the weights loaded
    weight_gb: float | None = None
    kv_gb: float | None = None  # the KV pool
    mamba_gb: float | None = None  # the mamba state pool (conv + ssm)
    version: str = ""
    # `/model_info`'s is_generation: False for an embedding server (`--is-embedding`), which takes
    # /v1/embeddings requests only (None: the server did not say; an older worker's record)
    is_generation: bool | None = None
    # new tokens one prefill forward takes: min(chunked_prefill_size, max_prefill_tokens) (None: not said).
    # An embedding finishes in the forward that admits it, so this, not the slots, bounds what runs at once.
    prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        enum_members(self)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker: str
    host: str
    queue: str
    gpu: int | None
    state: WorkerState
    server_url: str = ""
    strategy: Strategy = Strategy.DEFAULT
    server_flags: list[str] = field(default_factory=list)
    generation: int = 0  # the control generation this worker's server runs
    effective_max: int = 0
    slots: int = 0  # the worker's in-flight limit (its semaphore): capacity + surplus, or a lower cap
    surplus: int = 0  # requests the worker keeps waiting inside the server beyond its capacity, on purpose
    in_flight: int = 0
    done: int = 0
    failed: int = 0
    tokens_per_s: float = 0.0  # completion tokens/s measured by the worker over its last window
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    facts: ServerFacts | None = None  # None until the server has started (or from an older worker)
    message: str = ""
    ts: float = field(default_factory=time.time)
    # The server's parallel layout, read from the command line the worker starts it with
    # (`worker.flags.server_shape`): "tp1", "tp4", "tp2dp2+dpattn". "" from an older worker (one GPU).
    shape: str = ""
    start_s: float | None = None  # its server's last start, launch to healthy (None: not started yet)
    drain_s: float | None = None  # its last drain for a restart, drain + stop (None: none yet)
    gpu_name: str = ""  # the GPU model as nvidia-smi names it ("" when none answers)
    gpu_memory_mib: int | None = None  # its memory, MiB

    def __post_init__(self) -> None:
        enum_members(self)
        # The server's command line may hold its API key (`--api-key K`): never in a record, whoever
        # built it (this worker, or an older one whose record is read back).
        flags = redact_argv(self.server_flags) if isinstance(self.server_flags, list) else self.server_flags
        if flags != self.server_flags:
            object.__setattr__(self, "server_flags", flags)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerStatus:
        return loads(cls, raw)


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What may change between two starts of a GPU's server: the supervisor's knobs. A worker whose
    server runs another generation than the one asked of it restarts it (drain, stop, check the GPU
    is free, start, rediscover capacity, resume)."""

    generation: int = 0
    strategy: Strategy = field(default=Strategy.DEFAULT, metadata=REFUSE_UNKNOWN)  # a server runs only what it knows
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None

    def __post_init__(self) -> None:
        """The allow-list: a spec is data from Redis, so only values a server can sensibly run pass."""
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {str(self.strategy)!r} is not one of {', '.join(STRATEGIES)}")
        enum_members(self)
        if self.generation < 0:
            raise ValueError(f"generation {self.generation} is negative")
        lo, hi = MEM_FRACTION_RANGE
        if self.mem_fraction_static is not None and not lo <= self.mem_fraction_static <= hi:
            raise ValueError(f"mem_fraction_static {self.mem_fraction_static} is outside [{lo}, {hi}]")
        lo_n, hi_n = MAX_RUNNING_RANGE
        if self.max_running_requests is not None and not lo_n <= self.max_running_requests <= hi_n:
            raise ValueError(f"max_running_requests {self.max_running_requests} is outside [{lo_n}, {hi_n}]")

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ServerSpec:
        return loads(cls, raw)

    def describe(self) -> str:
        parts = [self.strategy]
        if self.mem_fraction_static is not None:
            parts.append(f"mem {self.mem_fraction_static:g}")
        if self.max_running_requests is not None:
            parts.append(f"max {self.max_running_requests}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    message: str
    source: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        enum_members(self)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Event:
        return loads(cls, raw)


@dataclass(frozen=True, slots=True)
class TenantFigures:
    """One tenant of a shared fleet, as its head feeds it (`producer.share`); one field of
    `Keys.tenants` per tenant, rewritten every pass while the run is live."""

    tenant: str
    weight: float = 1.0
    share: float = 0.0  # its part of the fleet's output tokens over the last minute
    tokens_per_s: float = 0.0  # its output tokens per second over the last minute
    load: float = 0.0  # its decayed usage over its weight: the tenant with the smallest is fed next
    in_redis: int = 0  # prompts fed, no result collected yet
    waiting: int = 0  # prompts in the store not fed yet
    fed: int = 0  # prompts this head fed it
    results: int = 0  # results this head collected for it
    output_tokens: int = 0  # their output tokens
    ts: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> TenantFigures:
        return loads(cls, raw)
