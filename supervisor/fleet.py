"""A snapshot of the fleet, read from Redis only: the workers' status records, the queue backlogs
and the run's counters (`batchfleet.fleetview`), and its events. The supervisor never talks to a
server; workers may be on other hosts."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import redis

from batchfleet.fleetview import FleetView, read_fleet_view
from batchfleet.keys import Keys
from batchfleet.records import Event, RecordError

__all__ = ["FleetSnapshot", "read_events", "read_fleet", "skip_record"]

log = logging.getLogger("batchfleet.supervisor")
_said: set[str] = set()


def skip_record(what: str, exc: Exception) -> None:
    """A malformed record is skipped, said once per distinct problem: never a reason to exit."""
    text = f"{what}: {exc}"
    if text not in _said:
        _said.add(text)
        log.warning("skipping a malformed record (%s)", text)


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetSnapshot(FleetView):
    """The fleet as `batchfleet.fleetview` reads it (workers newest per queue, silent ones, tokens/s,
    ETA), with the backlog of the queues the supervisor watches and the run's latest events."""

    events: list[Event] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**FleetView.to_dict(self), "events": [asdict(e) for e in self.events]}


def read_fleet(r: redis.Redis, k: Keys, *, queue_pattern: str = r"gpu\d+", events: int = 10) -> FleetSnapshot:
    view = read_fleet_view(r, k, queue_pattern=queue_pattern)
    raw_events = r.xrevrange(k.events, count=events)
    if view.gone:
        # A read-only user (the ACL's viewer) may not: the names stay until a supervisor drops them.
        with contextlib.suppress(redis.exceptions.NoPermissionError):
            r.srem(k.workers, *view.gone)
    return FleetSnapshot(**{f.name: getattr(view, f.name) for f in fields(FleetView)}, events=read_events(raw_events))


def read_events(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Event]:
    """Events from XREVRANGE entries, oldest first; malformed ones skipped. An event's `ts` is when Redis
    added it (its stream id), whatever the clock of the host that wrote it said."""
    out = []
    for eid, entry in reversed(entries):
        try:
            event = Event.from_json(entry[b"e"])
            ms, _, seq = eid.partition(b"-")
            # Redis's clock; the entry's sequence number orders events of one millisecond (strictly, so
            # "newer than the last seen" never drops one).
            out.append(replace(event, ts=int(ms) / 1000 + min(int(seq or 0), 999) * 1e-6))
        except (KeyError, RecordError) as exc:
            skip_record(f"event {eid!r}", exc)
    return out
