"""The records that travel through Redis, and their one JSON encoding.

- `Prompt`: the single argument of every RQ job (`jobs.GENERATE`); made by the producer.
- `Result`: one per finished prompt, success or final failure; workers append it to the results
  stream, the collector stores it, `producer export` writes it as an OpenAI batch output line.
- `WorkerStatus`: what each worker publishes every few seconds; the supervisor reads only these.
  Its `facts` (`ServerFacts`) are what the server said about itself at start-up: pool sizes, the
  cap and what caused it; they do not change while the server lives.
- `Event`: a decision or restart (`EventKind`), for `supervisor watch` and the audit trail.
- `ServerSpec`: the server configuration the supervisor wants, with its generation number
  (`Keys.control`: field `fleet` for every worker, `queue:<queue>` to override one GPU, e.g. a canary;
  keyed by queue, not worker name, so a restarted worker finds what was asked of its GPU).

Every closed set of values a record carries is a StrEnum (`WorkerState`, `Strategy`, `CapCause`,
`EventKind`); on the wire it is its value, a plain string. A record built in this process holds
members (a string given for such a field is turned into its member, or refused).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, TypeVar

import orjson

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
    "WorkerState",
    "WorkerStatus",
    "decode",
    "job_id_for",
    "prompt_wire",
]

log = logging.getLogger("batchfleet.records")


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


# --- decoding: records written by another process (maybe another version) ---------------------------
# A rolling upgrade runs old and new processes side by side, so a record may carry fields this
# version does not know: they are ignored, with one warning per record type and field set. A value
# of a StrEnum field this version does not know (a newer worker's state) is read as the enum's
# UNKNOWN member, with one warning per enum and value, and the rest of the record is kept -- except
# in a field marked REFUSE_UNKNOWN (what a server is asked to run: a worker cannot run what it does
# not know). A field of the wrong type, or a record that is not an object, is a RecordError: the
# reader decides what to do (skip the record, keep what it had), and never exits on it.

R = TypeVar("R")
_warned: set[tuple[str, frozenset[str]]] = set()
_warned_values: set[tuple[str, str]] = set()
_WARNED_VALUES_MAX = 1000  # a forger writing endless values gets that many warnings, then silence
REFUSE_UNKNOWN = {"refuse_unknown": True}  # dataclass field metadata: an unknown enum value is a RecordError


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return isinstance(value, str) and value in {m.value for m in hint}
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and hint.__module__ == __name__ and hasattr(hint, "__dataclass_fields__"):
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _record_type(hint: Any) -> type | None:
    """The record type a field holds (itself or inside `X | None`), for nested decoding."""
    return next((h for h in (hint, *typing.get_args(hint)) if isinstance(h, type)
                 and h.__module__ == __name__ and hasattr(h, "__dataclass_fields__")), None)


# Per record type, worked out once (decode runs for every prompt a worker takes): field name ->
# (its type check, nested record type, StrEnum field), and the set of known names.
Check = typing.Callable[[Any], bool]


@dataclass(frozen=True, slots=True)
class _EnumField:
    enum: type[StrEnum]
    members: dict[str, StrEnum]  # value -> member
    unknown: StrEnum | None  # the enum's UNKNOWN member; None where an unknown value is refused

    @classmethod
    def of(cls, enum: type[StrEnum], *, refuse_unknown: bool) -> _EnumField:
        return cls(enum, {m.value: m for m in enum}, None if refuse_unknown else enum.__members__.get("UNKNOWN"))

    def member(self, record: type, name: str, value: str) -> StrEnum:
        """The member of this value; an unknown one is UNKNOWN (one warning), or a RecordError."""
        member = self.members.get(value)
        if member is not None:
            return member
        if self.unknown is None:
            known = ", ".join(m.value for m in self.enum if m.name != "UNKNOWN")
            raise RecordError(f"{record.__name__}: {name} {value[:60]!r} is not one of {known}")
        key = (self.enum.__name__, value[:200])
        if key not in _warned_values and len(_warned_values) < _WARNED_VALUES_MAX:
            _warned_values.add(key)
            log.warning("%s record has %s %r, which this version does not know: read as %s.UNKNOWN, the rest of the "
                        "record kept (a newer batchfleet wrote it?)", record.__name__, name, value[:60],
                        self.enum.__name__)
        return self.unknown


_PLANS: dict[type, tuple[frozenset[str], dict[str, tuple[Check, type | None, _EnumField | None]]]] = {}


def _check_for(hint: Any) -> Check:
    """The type check of one field, as a bare isinstance wherever the hint allows (it runs for every
    field of every prompt a worker takes)."""
    origin = typing.get_origin(hint)
    if _is_enum(hint):  # any string: a value this version does not know is handled by _EnumField
        return lambda v: isinstance(v, str)
    if hint in (str, bool, dict, list):
        return lambda v, t=hint: isinstance(v, t)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if origin in (dict, list):  # dict[str, Any], list[str]: the container is checked, not its items
        return lambda v, t=origin: isinstance(v, t)
    return lambda v: _type_ok(v, hint)


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, StrEnum)


def _plan(cls: type) -> tuple[frozenset[str], dict[str, tuple[Check, type | None, _EnumField | None]]]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        per_field = {}
        for f in fields(cls):  # type: ignore[arg-type]
            hint = hints[f.name]
            enum = _EnumField.of(hint, refuse_unknown=bool(f.metadata.get("refuse_unknown"))) \
                if _is_enum(hint) else None
            per_field[f.name] = (_check_for(hint), _record_type(hint), enum)
        plan = _PLANS[cls] = (frozenset(per_field), per_field)
    return plan


_ENUM_FIELDS: dict[type, tuple[tuple[str, type[StrEnum]], ...]] = {}


def _members(record: Any) -> None:
    """In a record's __post_init__: each StrEnum field holds a member, not the string it was given
    (ValueError for a string that is none of them). Decoded records hold members already."""
    cls = type(record)
    enums = _ENUM_FIELDS.get(cls)
    if enums is None:
        enums = _ENUM_FIELDS[cls] = tuple((name, e.enum) for name, (_, _, e) in _plan(cls)[1].items() if e is not None)
    for name, enum in enums:
        value = getattr(record, name)
        if type(value) is not enum:
            object.__setattr__(record, name, enum(value))


def decode(cls: type[R], data: Any) -> R:
    """Build record `cls` from a decoded JSON object: unknown fields ignored (one warning), known
    fields type-checked, nested records decoded the same way. Raises RecordError."""
    if not isinstance(data, dict):
        raise RecordError(f"{cls.__name__}: not a JSON object ({type(data).__name__})")
    known, per_field = _plan(cls)
    if not known.issuperset(data):
        unknown = frozenset(data) - known
        if (cls.__name__, unknown) not in _warned:
            _warned.add((cls.__name__, unknown))
            log.warning("%s record has field(s) this version does not know, ignored: %s (a newer batchfleet "
                        "wrote it?)", cls.__name__, ", ".join(sorted(map(str, unknown)))[:200])
    values: dict[str, Any] = {}
    for name, value in data.items():
        entry = per_field.get(name)
        if entry is None:
            continue
        check, sub, enum = entry
        if not check(value):
            raise RecordError(f"{cls.__name__}.{name}: unexpected value {orjson.dumps(value).decode()[:60]}")
        if sub is not None and isinstance(value, dict):
            value = decode(sub, value)
        elif enum is not None:
            value = enum.member(cls, name, value)
        values[name] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a required field missing, or __post_init__ refused it
        raise RecordError(f"{cls.__name__}: {exc}") from None


def loads(cls: type[R], raw: bytes | str) -> R:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RecordError(f"{cls.__name__}: not JSON ({exc})") from None
    return decode(cls, data)

# The OpenAI batch `url`s batchfleet serves, each the same path on an SGLang server.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def job_id_for(run: str, cid: str) -> str:
    """The RQ job id of a prompt: the same custom_id in the same run is always the same job, which
    is what makes enqueueing idempotent. Hashed so any custom_id (long, odd characters) is safe."""
    return "bf-" + hashlib.blake2b(f"{run}\0{cid}".encode(), digest_size=12).hexdigest()


def prompt_wire(cid: str, seq: int, url: str, body: Any, *, src: str = "", fp: str = "",
                run: str = "") -> dict[str, Any]:
    """A prompt record as it travels in a job, `Prompt.from_dict` reads it back. `body` may be an
    `orjson.Fragment` (the head splices in the body as the store holds it). Empty fields are left out,
    and `run` comes last: every job of a run ends alike (`producer.ends.run_jobs` finds them so)."""
    d: dict[str, Any] = {"cid": cid, "seq": seq, "url": url, "body": body}
    if src:
        d["src"] = src
    if fp:
        d["fp"] = fp
    if run:
        d["run"] = run
    return d


@dataclass(frozen=True, slots=True)
class Prompt:
    cid: str  # the user's custom_id
    seq: int  # position in the run, so the export keeps input order
    url: str  # one of ENDPOINTS
    body: dict[str, Any]  # the OpenAI request body, sent as is
    src: str = ""  # "file:line", for messages
    run: str = ""  # the run it belongs to: its result goes to that run's stream, so a worker checks it
    fp: str = ""  # the request's fingerprint (hex, from the store): its Result echoes it, see Result.fp

    def to_dict(self) -> dict[str, Any]:
        return prompt_wire(self.cid, self.seq, self.url, self.body, src=self.src, fp=self.fp, run=self.run)

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
        all, or a 200 that was not JSON), with `response` null."""
        answered = self.error is None or (100 <= self.status_code <= 599 and self.status_code != 200)
        if not answered:
            return {"id": f"batch_req_{self.jid}", "custom_id": self.cid, "response": None, "error": self.error}
        body = self.body
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

    def __post_init__(self) -> None:
        _members(self)


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
        _members(self)
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
        _members(self)
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
        _members(self)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Event:
        return loads(cls, raw)
