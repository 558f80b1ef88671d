"""A snapshot of the fleet, read from Redis only: the workers' status records, the queue backlogs
and the run's counters. The supervisor never talks to a server; workers may be on other hosts."""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis

from batchfleet.config import DEFAULT_QUEUE_PATTERN
from batchfleet.keys import RQ_QUEUE_PREFIX, RQ_QUEUES, Keys
from batchfleet.records import Event, RecordError, WorkerStatus

__all__ = ["FleetSnapshot", "read_fleet"]

log = logging.getLogger("batchfleet.supervisor")
_said: set[str] = set()


def skip_record(what: str, exc: Exception) -> None:
    """A malformed record is skipped, said once per distinct problem: never a reason to exit."""
    text = f"{what}: {exc}"
    if text not in _said:
        _said.add(text)
        log.warning("skipping a malformed record (%s)", text)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    ts: float
    workers: list[WorkerStatus]
    backlog: dict[str, int]  # queue -> prompts waiting in Redis
    stats: dict[str, int]
    events: list[Event] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(w.tokens_per_s for w in self.workers if w.state == "serving")

    @property
    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    @property
    def total_backlog(self) -> int:
        return sum(self.backlog.values())

    def eta_s(self) -> float | None:
        """Seconds until the backlog is done at the fleet's current tokens/s, None when unknown.

        Tokens per prompt come from the prompts that finished; before any has, from what the prompts
        in flight have generated so far, a lower bound (they are not done), so the ETA is one too."""
        done = self.stats.get("succeeded", 0) + self.stats.get("failed", 0)
        tokens = self.stats.get("completion_tokens", 0)
        remaining = self.total_backlog + self.in_flight
        if remaining == 0:
            return 0.0
        if self.tokens_per_s <= 0:
            return None
        if done and tokens:
            per_prompt = tokens / done
        else:
            generated = sum(w.metrics.generation_tokens_total or 0 for w in self.workers)
            if not generated or not self.in_flight:
                return None
            per_prompt = generated / self.in_flight
        return remaining * per_prompt / self.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"ts": self.ts, "tokens_per_s": round(self.tokens_per_s, 1), "in_flight": self.in_flight,
                "backlog": self.backlog, "total_backlog": self.total_backlog, "eta_s": self.eta_s(),
                "stats": self.stats, "workers": [asdict(w) for w in self.workers],
                "events": [asdict(e) for e in self.events]}


def read_fleet(r: redis.Redis, k: Keys, *, queue_pattern: str = DEFAULT_QUEUE_PATTERN,
               events: int = 10) -> FleetSnapshot:
    """One snapshot. Its `ts` and every event's `ts` are Redis's clock (TIME, stream ids), so the
    supervisor never compares its own clock with a worker host's."""
    names = sorted(m.decode() for m in r.smembers(k.workers))
    queues = sorted(m.decode()[len(RQ_QUEUE_PREFIX):] for m in r.smembers(RQ_QUEUES))
    queues = [q for q in queues if re.fullmatch(queue_pattern, q)]
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.get(k.status(name))
    for q in queues:
        pipe.llen(Keys.queue(q))
    pipe.hgetall(k.stats)
    pipe.xrevrange(k.events, count=events)
    pipe.time()
    out = pipe.execute()
    raw_status, lengths, stats, raw_events = out[:len(names)], out[len(names):-3], out[-3], out[-2]
    seconds, micros = out[-1]
    workers = []
    gone = []
    for name, raw in zip(names, raw_status, strict=True):
        if raw is None:
            gone.append(name)  # its record expired: the worker is gone
            continue
        try:
            workers.append(WorkerStatus.from_json(raw))
        except RecordError as exc:
            skip_record(f"status of {name}", exc)
    if gone:
        r.srem(k.workers, *gone)
    workers.sort(key=lambda w: (w.gpu if w.gpu is not None else 1_000_000, w.host, w.worker))
    counters: dict[str, int] = {}
    for kk, v in stats.items():
        try:
            counters[kk.decode()] = int(float(v))
        except ValueError as exc:
            skip_record(f"counter {kk!r}", exc)
    return FleetSnapshot(
        ts=seconds + micros / 1e6, workers=workers, backlog=dict(zip(queues, lengths, strict=True)),
        stats=counters, events=read_events(raw_events))


def read_events(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Event]:
    """Events from XREVRANGE entries, oldest first; malformed ones skipped. An event's `ts` is when Redis
    added it (its stream id), whatever the clock of the host that wrote it said."""
    out = []
    for eid, fields in reversed(entries):
        try:
            event = Event.from_json(fields[b"e"])
            out.append(replace(event, ts=int(eid.partition(b"-")[0]) / 1000))
        except (KeyError, RecordError) as exc:
            skip_record(f"event {eid!r}", exc)
    return out
