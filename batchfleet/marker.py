"""The run marker: which store is a run's source of truth, recorded in Redis (`Keys.meta`, a hash).

The producer writes it when a run is first enqueued (and restores it after repairing a loss): the
store's host, absolute path and id (a uuid kept in the store), when it was created, and the queues
given for the run. It has no TTL while the run has prompts in Redis. So a run whose store has prompts
in Redis (FED) but whose marker is gone has lost its Redis data (a restart without persistence, a
failover to a replica that missed writes): every process that notices says so with `repair_command`,
and the head repairs it by itself.

A run that ended (every prompt has its result, or it was cancelled) gets the field `FINISHED` in its
marker, and then a TTL on its keys (`producer.ends`): when that marker goes, nothing was lost.

Read side: the marker is data from Redis, validated here; a malformed one is a `RecordError`.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import PurePath

import redis
import redis.asyncio as aioredis

from .errors import RecordError
from .keys import Keys, valid_queue_name

__all__ = ["FINISHED", "MarkerWatch", "RunMarker", "read_marker", "repair_command"]

FINISHED = "finished"  # marker field: the run ended and its keys expire (the head's time, informational)


@dataclass(frozen=True, slots=True)
class RunMarker:
    store_id: str
    host: str
    path: str  # absolute path of the store file on `host`
    created: float
    queues: tuple[str, ...] = ()  # queues given explicitly for the run (--queues / BATCHFLEET_QUEUES)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.path}"

    @property
    def state_dir(self) -> str:
        return str(PurePath(self.path).parent)

    def to_mapping(self) -> dict[str, str]:
        return {"store_id": self.store_id, "host": self.host, "path": self.path, "created": repr(self.created),
                "queues": ",".join(self.queues)}

    @classmethod
    def from_mapping(cls, raw: dict[bytes, bytes]) -> RunMarker:
        try:
            d = {k.decode(): v.decode() for k, v in raw.items()}
            queues = tuple(q for q in d.get("queues", "").split(",") if q)
            marker = cls(store_id=d["store_id"], host=d["host"], path=d["path"], created=float(d["created"]),
                         queues=queues)
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise RecordError(f"run marker: malformed ({type(exc).__name__}: {exc})") from None
        if not (marker.store_id.isalnum() and len(marker.store_id) <= 64 and marker.host and len(marker.host) <= 255
                and PurePath(marker.path).is_absolute() and all(valid_queue_name(q) for q in queues)):
            raise RecordError(f"run marker: unexpected values {d}"[:300])
        return marker


def read_marker(r: redis.Redis, keys: Keys) -> RunMarker | None:
    """The run's marker, None when Redis has none. Raises RedisError, RecordError."""
    raw = r.hgetall(keys.meta)
    return RunMarker.from_mapping(raw) if raw else None


def repair_command(run: str, state_dir: str | None = None) -> str:
    """The exact command that requeues a run's lost prompts from its store."""
    where = f" --state-dir {shlex.quote(state_dir)}" if state_dir else ""
    return f"producer --run {shlex.quote(run)}{where} recover"


class MarkerWatch:
    """A worker's cheap look at the marker, from a loop it already runs: one warning line when the
    marker it saw goes missing (or is missing while it has work of the run), one when it is back."""

    def __init__(self, keys: Keys, log: logging.Logger) -> None:
        self.keys = keys
        self.log = log
        self.seen: tuple[str, str] | None = None  # (host, path) of the store, from the last marker seen
        self.warned = False
        self.finished = False  # the last marker seen said the run ended: its keys expire, nothing is lost

    async def check(self, client: aioredis.Redis, *, busy: bool) -> bool:
        """True when the marker is there. `busy`: this worker holds or finished prompts of the run."""
        host, path, finished = await client.hmget(self.keys.meta, "host", "path", FINISHED)
        if host is not None and path is not None:
            self.seen = (host.decode(errors="replace"), path.decode(errors="replace"))
            self.finished = finished is not None
            if self.warned:
                self.warned = False
                self.log.warning("run marker %s is back", self.keys.meta)
            return True
        if self.finished:  # expired (or purged) after the run ended: not a loss
            self.finished, self.seen = False, None
            self.log.info("run %s ended and its keys expired (%s is gone)", self.keys.run, self.keys.meta)
            return False
        if not self.warned and (self.seen or busy):
            self.warned = True
            run = self.keys.run
            if self.seen:
                where = f"on {self.seen[0]}: {repair_command(run, str(PurePath(self.seen[1]).parent))}"
            else:
                where = f"on the head host: {repair_command(run)} (with --state-dir of the run's store)"
            self.log.warning(
                "Redis lost the data of run %s (its marker %s is gone: restarted without persistence, or a "
                "failover to a replica that missed writes). Prompts queued there are gone; the head process "
                "(`producer head`) requeues them from the store by itself, or repair it %s", run, self.keys.meta,
                where)
        return False
