"""The fleet as every process reads it: one reader of the workers' status records, one set of answers.

Each worker writes its `WorkerStatus` to `bf:<run>:status:<worker>` every few seconds with a TTL
(`keys.STATUS_TTL_S`), as arq's `record_health` does; nothing reaches into a worker. `read_fleet_view`
reads the records once and answers, for the producer (`status`), the head (its window), the
supervisor (`watch`, `status`, Prometheus, its history) and `batchfleet run` (its progress line):

- **which workers**: the newest record of each queue. A queue is a GPU's stable identity: a worker
  killed and restarted under a new name leaves its old record behind until it expires. "Newest" is
  decided on Redis's clock: the record with the most TTL left was written last (a record's own `ts` is
  its host's clock and breaks ties only).
- **live or silent**: a record rewritten within `SILENT_AFTER_S` (its TTL left, Redis's clock) is live;
  an older one is silent: its worker is gone or stuck. A silent worker still shows, and counts for
  nothing below.
- **capacity** per queue: the live workers' effective capacity (the head sizes its window on it).
- **tokens per second**: completion tokens per wall-clock second, summed over the live serving workers,
  each the slope of its server's generated-tokens counter over its last ~10 s (`worker.meter`).
- **ETA**: pending prompts x mean completion tokens of a succeeded prompt / tokens per second. Before
  any prompt has succeeded, the tokens generated so far per prompt in flight stand in: a lower bound,
  said as "at least". Pending is the store's count: the caller's when it holds the store, else what
  the head last published (`stats` field `store_pending`), else what Redis holds (waiting in the store,
  queued, in flight).

A record is data from another process, maybe another version. One this version cannot read is
skipped with one warning per distinct problem and counted (`unreadable`); a value it does not know
in a field it does (a new worker state) is `records.decode`'s to take, and such a worker keeps its
queue and capacity here.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from .keys import (
    CACHED_TOKENS,
    PLAN_BYTES,
    PLAN_SHARED,
    PROMPT_TOKENS,
    RQ_QUEUE_PREFIX,
    RQ_QUEUES,
    STATUS_TTL_S,
    STORE_PENDING,
    STORE_WAITING,
    Keys,
    valid_queue_name,
)
from .marker import FINISHED
from .records import MAX_RUNNING_RANGE, RecordError, WorkerState, WorkerStatus

__all__ = ["LEAVE_ALL", "SILENT_AFTER_S", "YIELDED_STATES", "Eta", "FleetView", "aread_fleet_view", "duration_text",
           "eta_text", "read_fleet_view"]

log = logging.getLogger("batchfleet.fleetview")

SILENT_AFTER_S = 10.0  # a record not rewritten for this long (workers write every 2 s by default): silent
MAX_TOKENS_PER_S = 1e7  # one worker's tokens/s beyond this is not a measurement
# A queue whose live worker is in one of these states is another worker's to take whole (worker/steal.py)
YIELDED_STATES = frozenset({WorkerState.DOWN, WorkerState.FAILED, WorkerState.DRAINING})
LEAVE_ALL = sys.maxsize  # `FleetView.left_to_owner` of a queue whose worker starts: a thief takes none of it
_said: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.warning("%s", text)


def duration_text(seconds: float) -> str:
    """`5m03s`, `2h07m`."""
    s = max(0, round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def eta_text(seconds: float | None, *, lower_bound: bool = False) -> str:
    """`5m03s`, `2h07m`, `at least 5m03s` (a lower bound), `unknown`."""
    if seconds is None or not math.isfinite(seconds):
        return "unknown"
    return f"at least {duration_text(seconds)}" if lower_bound else duration_text(seconds)


@dataclass(frozen=True, slots=True)
class Eta:
    seconds: float | None  # None: unknown (nothing measured yet)
    lower_bound: bool = False  # no prompt has succeeded yet: tokens per prompt are those generated so far

    @property
    def text(self) -> str:
        return eta_text(self.seconds, lower_bound=self.lower_bound)


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetView:
    """One reading of a run's fleet (see the module's docstring for what each answer means)."""

    ts: float = 0.0  # Redis's clock when it was read
    workers: Sequence[WorkerStatus] = ()  # the newest record of each queue, by host, GPU, name
    silent: frozenset[str] = frozenset()  # names of workers whose record stopped being rewritten
    stats: Mapping[str, int | float] = field(default_factory=dict)  # the run's counters and gauges
    backlog: Mapping[str, int] = field(default_factory=dict)  # queue -> prompts waiting (queues asked for)
    known: int = 0  # names in the run's workers set
    unreadable: int = 0  # records this version could not read (each problem warned once)
    gone: tuple[str, ...] = ()  # names whose record expired (the set may drop them)
    finished: bool = False  # the run marker says the run ended (every prompt has its result, or cancelled)
    cancelled: bool = False  # ... by `producer cancel`

    @property
    def live(self) -> list[WorkerStatus]:
        return [w for w in self.workers if w.worker not in self.silent]

    def left_to_owner(self, queue: str) -> int | None:
        """Of `queue`'s prompts, how many a worker stealing from it leaves to the worker serving it (the
        rule of worker/steal.py): all (LEAVE_ALL) while that worker starts, as its server takes the queue as
        soon as it is up; 0 when no worker of it has said anything yet (a thief takes half a claim of it);
        one load of its worker (its in-flight limit, bounded: a record is data) while it serves or
        restarts; None once it is gone (silent, or in YIELDED_STATES): all of it is another's."""
        owner = next((w for w in self.workers if w.queue == queue), None)
        if owner is None:
            return 0
        if owner.worker in self.silent or owner.state in YIELDED_STATES:
            return None
        if owner.state is WorkerState.STARTING:
            return LEAVE_ALL
        return max(0, min(owner.slots, MAX_RUNNING_RANGE[1]))

    def within_reach(self, queue: str) -> int:
        """Of the prompts waiting in the queues read, about how many a worker of `queue` may claim: all of
        its own queue's, and of another what a thief does not leave to its worker (`left_to_owner`). More
        than 0 means prompts wait that this worker could run."""
        n = 0
        for q, waiting in self.backlog.items():
            keep = None if q == queue else self.left_to_owner(q)
            n += max(0, waiting - (keep or 0))
        return n

    @property
    def is_generation(self) -> bool | None:
        """What the live workers' servers are (`ServerFacts.is_generation`): True generation, False
        embedding; None while none has said, or when they disagree (a fleet of both kinds)."""
        said = {w.facts.is_generation for w in self.live if w.facts is not None and w.facts.is_generation is not None}
        return said.pop() if len(said) == 1 else None

    @property
    def capacity(self) -> dict[str, int]:
        """Queue -> the effective capacity of its live worker (validated: a record is data)."""
        out: dict[str, int] = {}
        for w in self.live:
            out[w.queue] = out.get(w.queue, 0) + max(0, min(w.effective_max, MAX_RUNNING_RANGE[1]))
        return out

    def tokens_per_s_of(self, w: WorkerStatus) -> float:
        """One worker's part of `tokens_per_s`: its measure while it is live and serving, else 0 (a
        worker not serving keeps its last measure in its record)."""
        if w.worker in self.silent or w.state != WorkerState.SERVING:
            return 0.0
        return max(0.0, min(w.tokens_per_s, MAX_TOKENS_PER_S))

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per wall-clock second of the live serving workers."""
        return sum(self.tokens_per_s_of(w) for w in self.workers)

    @property
    def in_flight(self) -> int:
        return sum(max(0, w.in_flight) for w in self.live)

    @property
    def not_serving(self) -> list[tuple[str, str, str, str]]:
        """(worker, queue, state, message) of the live workers whose server is not serving."""
        return [(w.worker, w.queue, str(w.state), w.message[:500]) for w in self.live
                if w.state != WorkerState.SERVING]

    @property
    def total_backlog(self) -> int:
        return sum(self.backlog.values())

    @property
    def pending(self) -> int | None:
        """The store's pending count as the head last published it; None before any head did."""
        v = self.stats.get(STORE_PENDING)
        return None if v is None else max(0, int(v))

    def _ratio(self, part: str, whole: str, queue: str | None) -> float | None:
        suffix = f":{queue}" if queue else ""
        total = self.stats.get(whole + suffix, 0)
        return self.stats.get(part + suffix, 0) / total if total > 0 else None

    def hit_rate(self, queue: str | None = None) -> float | None:
        """Of the prompt tokens the servers (of `queue`) prefilled, the share their radix caches gave."""
        return self._ratio(CACHED_TOKENS, PROMPT_TOKENS, queue)

    def predicted_hit(self, queue: str) -> float | None:
        """The prefix plan's prediction for `queue` (bytes shared with the prompt before, of all)."""
        return self._ratio(PLAN_SHARED, PLAN_BYTES, queue)

    @property
    def predicted_hit_fleet(self) -> float | None:
        """The plan's prediction over every queue it fed."""
        shared = sum(v for k, v in self.stats.items() if k.startswith(PLAN_SHARED + ":"))
        size = sum(v for k, v in self.stats.items() if k.startswith(PLAN_BYTES + ":"))
        return shared / size if size > 0 else None

    @property
    def saved_tokens(self) -> int:
        """Prompt tokens the servers did not prefill: their radix caches had them."""
        return int(self.stats.get(CACHED_TOKENS, 0))

    @property
    def mean_completion_tokens(self) -> float | None:
        succeeded, tokens = self.stats.get("succeeded", 0), self.stats.get("completion_tokens", 0)
        return tokens / succeeded if succeeded > 0 and tokens > 0 else None

    @property
    def prompts_per_s(self) -> float | None:
        mean, tps = self.mean_completion_tokens, self.tokens_per_s
        return tps / mean if mean and tps > 0 else None

    def remaining(self, pending: int | None = None) -> int:
        """Prompts not finished: `pending` when the caller holds the store, else the head's figure,
        else what Redis holds (waiting in the store, queued on the queues read, in flight)."""
        if pending is not None:
            return pending
        if self.pending is not None:
            return self.pending
        return max(0, int(self.stats.get(STORE_WAITING, 0))) + self.total_backlog + self.in_flight

    def eta(self, pending: int | None = None) -> Eta:
        n = self.remaining(pending)
        if n <= 0:
            return Eta(0.0)
        tps = self.tokens_per_s
        if tps <= 0:
            return Eta(None)
        mean = self.mean_completion_tokens
        if mean is not None:
            return Eta(n * mean / tps)
        generated = sum(max(0.0, w.metrics.generation_tokens_total or 0.0) for w in self.live)
        if generated <= 0 or self.in_flight <= 0:
            return Eta(None)
        return Eta(n * (generated / self.in_flight) / tps, lower_bound=True)

    def to_dict(self) -> dict[str, Any]:
        eta = self.eta()
        return {"ts": self.ts, "tokens_per_s": round(self.tokens_per_s, 1), "in_flight": self.in_flight,
                "backlog": dict(self.backlog), "total_backlog": self.total_backlog, "eta_s": eta.seconds,
                "eta": eta.text, "eta_lower_bound": eta.lower_bound, "live": len(self.live), "known": self.known,
                "silent": sorted(self.silent), "unreadable": self.unreadable, "finished": self.finished,
                "cancelled": self.cancelled, "stats": dict(self.stats), "workers": [asdict(w) for w in self.workers]}


def _number(name: str, raw: bytes) -> int | float | None:
    try:
        f = float(raw)
    except ValueError:
        _warn_once(f"run counter {name!r} holds {raw[:40]!r}, not a number: ignored")
        return None
    if not math.isfinite(f):
        return None
    return int(f) if f.is_integer() else f


def read_fleet_view(r: redis.Redis, keys: Keys, *, queue_pattern: str | None = None,
                    silent_after_s: float = SILENT_AFTER_S) -> FleetView:
    """Read the run's fleet in two round trips. `queue_pattern`: also the backlog of every RQ queue
    whose name matches it (the supervisor's view of the queues)."""
    pipe = r.pipeline(transaction=False)
    _ask_names(pipe, keys, queue_pattern)
    names, queues = _names(pipe.execute(), queue_pattern)
    pipe = r.pipeline(transaction=False)
    _ask_records(pipe, keys, names, queues)
    return _view(names, queues, pipe.execute(), silent_after_s)


async def aread_fleet_view(r: aioredis.Redis, keys: Keys, *, queue_pattern: str | None = None,
                           silent_after_s: float = SILENT_AFTER_S) -> FleetView:
    """`read_fleet_view` on an asyncio client (a worker's)."""
    async with r.pipeline(transaction=False) as pipe:
        _ask_names(pipe, keys, queue_pattern)
        names, queues = _names(await pipe.execute(), queue_pattern)
    async with r.pipeline(transaction=False) as pipe:
        _ask_records(pipe, keys, names, queues)
        return _view(names, queues, await pipe.execute(), silent_after_s)


def _ask_names(pipe: Any, keys: Keys, queue_pattern: str | None) -> None:
    pipe.smembers(keys.workers)
    if queue_pattern is not None:
        pipe.smembers(RQ_QUEUES)


def _names(out: list[Any], queue_pattern: str | None) -> tuple[list[str], list[str]]:
    raw_names, *raw_queues = out
    names = sorted(n.decode(errors="replace") for n in raw_names)
    queues: list[str] = []
    if queue_pattern is not None:
        for m in sorted(q.decode(errors="replace") for q in raw_queues[0]):
            q = m[len(RQ_QUEUE_PREFIX):]
            if m.startswith(RQ_QUEUE_PREFIX) and valid_queue_name(q) and re.fullmatch(queue_pattern, q):
                queues.append(q)
    return names, queues


def _ask_records(pipe: Any, keys: Keys, names: list[str], queues: list[str]) -> None:
    for name in names:
        pipe.get(keys.status(name))
        pipe.pttl(keys.status(name))
    for q in queues:
        pipe.llen(Keys.queue(q))
    pipe.hgetall(keys.stats)
    pipe.hget(keys.meta, FINISHED)
    pipe.hget(keys.cancel, "at")
    pipe.time()


def _view(names: list[str], queues: list[str], out: list[Any], silent_after_s: float) -> FleetView:
    n = 2 * len(names)
    lengths = out[n:n + len(queues)]
    raw_stats, finished, cancelled, (seconds, micros) = out[n + len(queues):]

    newest: dict[str, tuple[tuple[float, float], WorkerStatus, float | None]] = {}
    gone: list[str] = []
    unreadable = 0
    for i, name in enumerate(names):
        raw, pttl = out[2 * i], out[2 * i + 1]
        if raw is None:
            gone.append(name)  # its record expired: the worker is gone
            continue
        try:
            w = WorkerStatus.from_json(raw)
            if not valid_queue_name(w.queue):
                raise RecordError(f"WorkerStatus.queue: not a queue name: {w.queue!r}"[:120])
        except RecordError as exc:
            unreadable += 1
            _warn_once(f"status record of worker {name!r} skipped: this version cannot read it ({exc})")
            continue
        # Its age on Redis's clock: a worker writes it with STATUS_TTL_S; None when it has no TTL.
        age = STATUS_TTL_S - pttl / 1000 if isinstance(pttl, int) and pttl >= 0 else None
        rank = (-(age or 0.0), w.ts)
        if w.queue not in newest or rank > newest[w.queue][0]:
            newest[w.queue] = (rank, w, age)
    workers = sorted((w for _, w, _ in newest.values()),
                     key=lambda w: (w.host, w.gpu if w.gpu is not None else 1_000_000, w.worker))
    silent = frozenset(w.worker for _, w, age in newest.values() if age is not None and age > silent_after_s)
    stats: dict[str, int | float] = {}
    for k, v in raw_stats.items():
        name = k.decode(errors="replace")
        value = _number(name, v)
        if value is not None:
            stats[name] = value
    return FleetView(ts=seconds + micros / 1e6, workers=workers, silent=silent, stats=stats,
                     backlog=dict(zip(queues, lengths, strict=True)), known=len(names), unreadable=unreadable,
                     gone=tuple(gone), finished=finished is not None, cancelled=cancelled is not None)
