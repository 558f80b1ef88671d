"""A snapshot of the fleet, read from Redis only: the workers' status records, the queue backlogs
and the run's counters. The supervisor never talks to a server; workers may be on other hosts."""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis

from batchfleet.keys import RQ_QUEUE_PREFIX, RQ_QUEUES, STORE_WAITING, Keys
from batchfleet.records import Event, RecordError, WorkerStatus

__all__ = ["FleetSnapshot", "Freshness", "read_events", "read_fleet", "skip_record"]

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
    silent: frozenset[str] = frozenset()  # workers whose status record stopped changing (see Freshness)

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
        remaining = self.total_backlog + self.in_flight + self.stats.get(STORE_WAITING, 0)  # + not yet in Redis
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

    @property
    def eta_is_lower_bound(self) -> bool:
        """True while no prompt has finished: `eta_s` then counts only the tokens generated so far."""
        return not (self.stats.get("succeeded", 0) + self.stats.get("failed", 0)
                    and self.stats.get("completion_tokens", 0))

    def to_dict(self) -> dict[str, Any]:
        return {"ts": self.ts, "tokens_per_s": round(self.tokens_per_s, 1), "in_flight": self.in_flight,
                "backlog": self.backlog, "total_backlog": self.total_backlog, "eta_s": self.eta_s(),
                "stats": self.stats, "workers": [asdict(w) for w in self.workers],
                "events": [asdict(e) for e in self.events]}


class Freshness:
    """Which workers' status records stopped changing, judged on the supervisor's own clock only (a
    record's `ts` is its host's clock: it is compared with that same record's earlier `ts`, never with
    another host's or ours). A killed worker's record lives on until it expires (30 s); this says sooner."""

    def __init__(self, silent_after_s: float = 10.0) -> None:
        self.silent_after_s = silent_after_s
        self._seen: dict[str, tuple[float, float]] = {}  # worker -> (its record's ts, our time it changed)

    def observe(self, workers: list[WorkerStatus], now: float) -> frozenset[str]:
        silent = set()
        for w in workers:
            ts, since = self._seen.get(w.worker, (None, now))
            if ts != w.ts:
                since = now
            self._seen[w.worker] = (w.ts, since)
            if now - since > self.silent_after_s:
                silent.add(w.worker)
        for name in set(self._seen) - {w.worker for w in workers}:
            del self._seen[name]
        return frozenset(silent)


def read_fleet(r: redis.Redis, k: Keys, *, queue_pattern: str = r"gpu\d+", events: int = 10,
               freshness: Freshness | None = None) -> FleetSnapshot:
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
        # A read-only user (the ACL's viewer) may not: the names stay until a supervisor drops them.
        with contextlib.suppress(redis.exceptions.NoPermissionError):
            r.srem(k.workers, *gone)
    # One record per queue (a GPU's stable identity): a worker killed and restarted under a new name
    # leaves its old record until it expires; the newest of the same queue is the live one.
    newest: dict[str, WorkerStatus] = {}
    for w in workers:
        if w.queue not in newest or w.ts > newest[w.queue].ts:
            newest[w.queue] = w
    workers = sorted(newest.values(), key=lambda w: (w.host, w.gpu if w.gpu is not None else 1_000_000, w.worker))
    counters: dict[str, int] = {}
    for kk, v in stats.items():
        try:
            counters[kk.decode()] = int(float(v))
        except ValueError as exc:
            skip_record(f"counter {kk!r}", exc)
    now = seconds + micros / 1e6  # Redis's clock: the supervisor never compares its own with a worker host's
    return FleetSnapshot(
        ts=now, workers=workers, backlog=dict(zip(queues, lengths, strict=True)),
        stats=counters, events=read_events(raw_events),
        silent=freshness.observe(workers, now) if freshness is not None else frozenset())


def read_events(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Event]:
    """Events from XREVRANGE entries, oldest first; malformed ones skipped. An event's `ts` is when Redis
    added it (its stream id), whatever the clock of the host that wrote it said."""
    out = []
    for eid, fields in reversed(entries):
        try:
            event = Event.from_json(fields[b"e"])
            ms, _, seq = eid.partition(b"-")
            # Redis's clock; the entry's sequence number orders events of one millisecond (strictly, so
            # "newer than the last seen" never drops one).
            out.append(replace(event, ts=int(ms) / 1000 + min(int(seq or 0), 999) * 1e-6))
        except (KeyError, RecordError) as exc:
            skip_record(f"event {eid!r}", exc)
    return out
